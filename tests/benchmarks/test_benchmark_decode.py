"""experiments/benchmarks/decode.py on CPU at tiny sizes: every step row and the generation row
time without error and land in the JSON and the markdown table; the bandwidth bookkeeping."""

from __future__ import annotations

import json

import pytest

from experiments.benchmarks import decode


def test_decode_benchmark_runs_and_writes_tables(tmp_path):
  out = str(tmp_path / "decode")
  rows = ["diag_kdn_xla", "iso_kdn_xla", "kda_xla", "diag_kdn_pallas", "fla_fused_recurrent_kda"]
  res = decode.run(
    out,
    [2],
    heads=2,
    dim=16,
    steps=3,
    reps=1,
    warmup=0,
    rows=rows,
    lm_config="configs/lm_125m.py:smoke",
    lm_batches=[1],
    prompt_len=8,
    new_tokens=3,
    time_budget_s=600,
    pallas_interpret=True,
  )
  with open(out + ".json", encoding="utf-8") as f:
    assert json.load(f) == json.loads(json.dumps(res))
  timed = {r["row"]: r for r in res["steps"]}
  # (no GPU here: fla is skipped, not failed; the Pallas row runs in interpret mode)
  assert set(timed) == {"diag_kdn_xla", "iso_kdn_xla", "kda_xla", "diag_kdn_pallas"}
  for r in timed.values():
    assert r["us_per_step"] > 0 and r["floor_us"] is None, r
  assert timed["diag_kdn_pallas"]["rel_err_state_vs_xla"] < 1e-5
  assert timed["kda_xla"]["state_bytes_moved"] == 2 * 2 * 2 * 16 * 16 * 4
  gen = res["generation"][0]
  assert gen["tokens_per_s"] > 0 and gen["time_to_first_token_s"] > 0, gen
  md = open(out + ".md", encoding="utf-8").read()
  assert "| diag_kdn_xla | 2 |" in md and "| 1 | 8 | 3 |" in md


def test_hbm_table():
  assert decode.hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
  assert decode.hbm_tbps("NVIDIA H100 PCIe") == 2.0
  assert decode.hbm_tbps("NVIDIA H200") == 4.8
  assert decode.hbm_tbps("cpu") is None
  assert decode.state_bytes("diag_kdn_xla", 1, 2, 4) == 2 * 16 * 4 + 2 * 4 * 4
  assert decode.state_bytes("iso_kdn_pallas", 1, 2, 4) == 2 * 16 * 4 + 2 * 4
  with pytest.raises(ValueError, match="--rows: unknown step row 'nope_xla'"):
    decode.step_fn("nope_xla")
