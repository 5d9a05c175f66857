"""docs/performance.md is exactly what render_performance makes of the committed JSON (never
hand-edited); the renderer's ratios, gaps and records on small made-up inputs."""

from __future__ import annotations

import json
import os

import pytest

from experiments.benchmarks import render_performance as rp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_performance_md_is_rendered_from_the_committed_json():
  md = rp.render(os.path.join(ROOT, "docs", "performance"))
  with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
    committed = f.read()
  assert md == committed, (
    "docs/performance.md is stale: run python -m experiments.benchmarks.render_performance"
  )


def _write(path, meta, result):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"meta": meta, "result": result}, f)


META = {"device": "Test GPU", "date": "2030-01-02", "command": "bench --x", "commit": "abc1234"}


def test_ratios_missing_fla_cells_and_sources(tmp_path):
  mixers = {
    "jax": "9.9",
    "rows": [
      {"row": "diag_kdn_pallas", "mode": "fwd", "T": 64, "ms": 3.0},
      {"row": "diag_kdn_pallas", "mode": "fwd+bwd", "T": 64, "ms": 9.0},
      {"row": "fla_chunk_kda", "mode": "fwd", "T": 64, "ms": 2.0},
      {"row": "diag_kdn_pallas", "mode": "fwd", "T": 32, "ms": 1.0},
    ],
  }
  layers = {
    "jax": "9.9",
    "rows": [
      {"row": "kdn_iso_pallas", "T": 64, "fwd_ms": 4.0, "fwd_bwd_ms": 8.0},
      {"row": "fla_kda_layer", "T": 64, "fwd_ms": 5.0, "fwd_bwd_ms": 16.0},
    ],
  }
  _write(str(tmp_path / "g" / "mixers.json"), dict(META, notes=["a note"]), mixers)
  _write(str(tmp_path / "g" / "layers.json"), META, layers)
  md = rp.render(str(tmp_path))
  assert "## Test GPU" in md
  # T ascending; the 32-token row has no fla cell and no fwd+bwd
  assert "| op vs `chunk_kda` | 32 | diag_kdn | 1.00 | – | – | – | – | – |" in md
  assert "| op vs `chunk_kda` | 64 | diag_kdn | 3.00 | 2.00 | 1.50x | 9.00 | – | – |" in md
  assert md.index("| 32 |") < md.index("| 64 | diag_kdn")
  assert (
    "| layer vs `KimiDeltaAttention` | 64 | kdn_iso | 4.00 | 5.00 | 0.80x | 8.00 | 16.00 | 0.50x |"
    in md
  )
  assert "- ops: `bench --x` — Test GPU, jax 9.9, 2030-01-02, commit abc1234." in md
  assert "- a note" in md
  assert "tokens/s" not in md


def test_training_line(tmp_path):
  summary = {"num_params": 116_803_032, "steady_tokens_per_s": 240_134.9, "num_steps": 30}
  _write(str(tmp_path / "g" / "train_125m.json"), dict(META, jax="0.1"), summary)
  md = rp.render(str(tmp_path))
  assert "116.8M parameters" in md and "**240.1k tokens/s**" in md and "30 steps" in md
  assert "- training: `bench --x` — Test GPU, jax 0.1," in md


def test_decode_table(tmp_path):
  steps = [
    {"row": "kda_pallas", "batch": 1, "us_per_step": 8.0},
    {"row": "fla_fused_recurrent_kda", "batch": 1, "us_per_step": 4.0},
    {"row": "kda_pallas", "batch": 16, "us_per_step": 30.0, "hbm_share": 0.5},
    {"row": "kda_pallas", "batch": 16, "us_per_step": 40.0, "hbm_share": 0.375},  # swept: slower
    {"row": "kda_pallas", "batch": 16, "error": "boom"},
  ]
  gen = [
    {
      "batch": 1,
      "prompt_len": 64,
      "new_tokens": 8,
      "time_to_first_token_s": 0.02,
      "decode_tokens_per_s": 1000.4,
    },
    {
      "impl": "pallas",
      "batch": 64,
      "prompt_len": 64,
      "new_tokens": 8,
      "time_to_first_token_s": 0.03,
      "decode_tokens_per_s": 9000.0,
      "ms_per_token": 7.11,
    },
    {"impl": "pallas", "batch": 256, "error": "OOM"},
  ]
  result = {"heads": 16, "dim": 128, "steps_per_call": 64, "steps": steps, "generation": gen}
  result["lm_config"] = "configs/x.py"
  _write(str(tmp_path / "g" / "decode.json"), dict(META, jax="0.2"), result)
  md = rp.render(str(tmp_path))
  assert "| row | B=1 | B=16 |" in md
  assert "| kda_pallas | 8.0 (2.00x) | 30.0 |" in md  # no fla cell at B=16: no ratio
  assert "| fla_fused_recurrent_kda | 4.0 | – |" in md
  assert "B=1, prompt 64, 8 new tokens: first token after 20 ms, then 1000 tokens/s." in md
  assert "greedy, impl pallas): B=64, prompt 64, 8 new tokens: first token after 30 ms, " in md
  assert "then 9000 tokens/s (7.11 ms per token)." in md and "B=256" not in md
  assert "Share of HBM bandwidth at B=16 (state read and written once): kda_pallas 50%." in md
  assert "- decode: `bench --x` — Test GPU, jax 0.2," in md


def test_bad_records_are_named(tmp_path):
  with pytest.raises(ValueError, match="no <gpu>/ folders"):
    rp.render(str(tmp_path))
  (tmp_path / "g").mkdir()
  with pytest.raises(ValueError, match="none of mixers.json"):
    rp.render(str(tmp_path))
  with open(tmp_path / "g" / "mixers.json", "w", encoding="utf-8") as f:
    json.dump({"meta": {"device": "x", "date": "y"}, "result": {"rows": []}}, f)
  with pytest.raises(ValueError, match="meta.command is missing"):
    rp.render(str(tmp_path))


def test_wrap_records_where_the_numbers_come_from(tmp_path):
  result = tmp_path / "results.json"
  result.write_text(json.dumps({"jax": "0.0", "rows": []}))
  out = tmp_path / "perf" / "mixers.json"
  rec = rp.wrap(str(result), "python3 -m x", "Test GPU", str(out))
  assert json.loads(out.read_text()) == rec
  assert rec["result"] == {"jax": "0.0", "rows": []}
  assert rec["meta"]["device"] == "Test GPU" and rec["meta"]["command"] == "python3 -m x"
  assert len(rec["meta"]["date"]) == 10 and rec["meta"]["jax"]
  with pytest.raises(FileNotFoundError, match="does not exist"):
    rp.wrap(str(tmp_path / "missing.json"), "c", "Test GPU", str(out))
  with pytest.raises(ValueError, match="--device"):
    rp.wrap(str(result), "c", "", str(out))


def test_guard_table_gives_each_scheme_against_no_guard(tmp_path):
  guard = {
    "impl": "pallas",
    "settings": {"b": 4, "t": [4096], "h": 16, "d": 128, "dtype": "bfloat16"},
    "schemes": ["none", "outputs", "inputs"],
    "rows": [
      {"op": "diag_kdn", "t": 4096, "pass_": "fwd", "none_ms": 2.0, "outputs_ms": 2.05,
       "inputs_ms": 2.6},
    ],
  }  # fmt: skip
  _write(str(tmp_path / "gpu" / "guard.json"), META, guard)
  md = rp.render(str(tmp_path))
  assert "| diag_kdn | 4096 | fwd | 2.000 | 2.050 (+2.5%) | 2.600 (+30.0%) |" in md
  assert "non-finite guard: `bench --x`" in md
