"""experiments/benchmarks/decode.py on CPU at tiny sizes: every step row and the generation rows
(of the model's impl) time without error and land in the JSON and the markdown table; the
block_v / num_warps sweep; the kernel counts from a profiler trace; the bandwidth bookkeeping."""

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
    block_v=[8, 16],  # (8 is the tuned value: timed once)
    lm_impls=["auto"],  # (a model of impl 'pallas' would prefill in interpret mode: slow here)
    profile_dir=str(tmp_path / "traces"),
  )
  with open(out + ".json", encoding="utf-8") as f:
    assert json.load(f) == json.loads(json.dumps(res))
  assert not [r for r in res["steps"] + res["generation"] if "error" in r]
  timed = {(r["row"], r.get("block_v")): r for r in res["steps"]}
  # (no GPU here: fla is skipped, not failed; the Pallas rows run in interpret mode, swept)
  assert set(timed) == {
    ("diag_kdn_xla", None),
    ("iso_kdn_xla", None),
    ("kda_xla", None),
    ("diag_kdn_pallas", 8),
    ("diag_kdn_pallas", 16),
  }
  for r in timed.values():
    assert r["us_per_step"] > 0 and r["floor_us"] is None and r["hbm_share"] is None, r
    assert r["kernels_per_step"] > 0, r  # (CPU: the host's XLA ops of the trace)
  assert timed[("diag_kdn_pallas", 8)]["rel_err_state_vs_xla"] < 1e-5
  assert timed[("kda_xla", None)]["state_bytes_moved"] == 2 * 2 * 2 * 16 * 16 * 4
  gen = {g["impl"]: g for g in res["generation"]}
  assert set(gen) == {"auto"}
  for g in gen.values():
    assert g["tokens_per_s"] > 0 and g["time_to_first_token_s"] > 0, g
    assert g["kernels_per_token"] > 0, g
  md = open(out + ".md", encoding="utf-8").read()
  assert "| diag_kdn_xla | 2 | - |" in md and "| diag_kdn_pallas | 2 | 8 / 1 |" in md
  assert "| auto | 1 | 8 | 3 |" in md


def test_hbm_table():
  assert decode.hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
  assert decode.hbm_tbps("NVIDIA H100 PCIe") == 2.0
  assert decode.hbm_tbps("NVIDIA H200") == 4.8
  assert decode.hbm_tbps("cpu") is None
  assert decode.state_bytes("diag_kdn_xla", 1, 2, 4) == 2 * 16 * 4 + 2 * 4 * 4
  assert decode.state_bytes("iso_kdn_pallas", 1, 2, 4) == 2 * 16 * 4 + 2 * 4
  with pytest.raises(ValueError, match="--rows: unknown step row 'nope_xla'"):
    decode.step_fn("nope_xla")


def test_sweep_configs_only_for_the_swept_pallas_rows():
  sweep = decode.sweep_configs("diag_kdn_pallas", ["diag_kdn_pallas"], [8, 32], [1, 4])
  assert [(c.block_v, c.num_warps) for c in sweep] == [(8, 1), (8, 4), (32, 1), (32, 4)]
  assert decode.sweep_configs("kda_pallas", ["diag_kdn_pallas"], [8, 32], []) == []
  assert decode.sweep_configs("diag_kdn_xla", ["diag_kdn_xla"], [8], []) == []
  assert decode.sweep_configs("diag_kdn_pallas", ["diag_kdn_pallas"], [], []) == []
