"""experiments/studies/results/copy_passkey.py renders the copying / passkey sections from a results folder alone."""

from __future__ import annotations

import json
import os

from experiments.studies.results import copy_passkey


def _write(path, obj):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f)


def _config(kind, strategy, steps, init_from="", **data):
  d = {
    "kind": kind,
    "seq_len": 202 if kind == "copying" else 128,
    "global_batch_size": 8,
    "copying": {"vocab_size": 32, "copy_len": 100, "min_copy_len": 50, "eval_copy_len": 0},
    "passkey": {"vocab_size": 64, "digits": 5},
  }
  d.update(data)
  return {
    "model": {
      "mixer": "kdn_diag",
      "num_layers": 2,
      "d_model": 64,
      "num_heads": 2,
      "head_dim": 64,
      "mlp_hidden": 128,
      "vocab_size": 32,
    },
    "data": d,
    "train": {"initial_state": strategy, "num_steps": steps, "init_from": init_from},
  }


def _copy_run(root, run, strategy, acc):
  d = os.path.join(root, "copying", "kdn_diag", run)
  _write(
    os.path.join(d, "config.json"), _config("copying", strategy, 300, "workdirs/copying/pretrain")
  )
  _write(os.path.join(d, "summary.json"), {"eval": {"accuracy": 0.9}})
  rows = [
    {
      "task": "copy",
      "length": 2 * n + 2,
      "axis": "copy_len",
      "copy_len": n,
      "token_accuracy": a,
      "exact_match": a / 2,
      "num_examples": 4,
    }
    for n, a in acc.items()
  ]
  _write(
    os.path.join(d, "eval", "retrieval.json"), {"tasks": {"copy": rows}, "examples_per_cell": 4}
  )


def test_render_from_json_only(tmp_path):
  res, figs = str(tmp_path / "results"), str(tmp_path / "figures")
  assert copy_passkey.render(res, figs) == ""  # nothing run yet
  _copy_run(res, "zero", "zero", {50: 0.95, 100: 0.9, 201: 0.31, 403: 0.123})
  _copy_run(res, "state_passing", "state_passing", {50: 0.94, 100: 0.9, 201: 0.52, 403: 0.456})
  _write(
    os.path.join(res, "copying", "commands.json"),
    {
      "machine": "test cpu",
      "protocol": "pretrain, then post-train",
      "runs": {"kdn_diag/zero": "python -m experiments.train ZERO_CMD"},
      "evaluate": {"kdn_diag/zero": "python -m experiments.evaluate EVAL_CMD"},
    },
  )
  for run, strategy, far in (
    ("pretrain", "zero", 0.25),
    ("zero", "zero", 0.5),
    ("state_passing", "state_passing", 0.75),
  ):
    pk = os.path.join(res, "passkey", "kdn_diag", run)
    _write(
      os.path.join(pk, "config.json"),
      _config("passkey", strategy, 1000 if run == "pretrain" else 300),
    )
    cells = [
      {
        "task": "passkey",
        "length": n,
        "axis": "depth",
        "depth": d,
        "exact_match": 1.0 if n < 512 else far,
        "token_accuracy": 1.0,
      }
      for n in (128, 512)
      for d in (0.0, 1.0)
    ]
    _write(
      os.path.join(pk, "eval", "retrieval.json"),
      {"tasks": {"passkey": cells}, "examples_per_cell": 4},
    )

  md = copy_passkey.render(res, figs)
  assert md.startswith("## 4. Copying and passkey")
  assert "### Copying" in md and "### Passkey" in md
  assert "ZERO_CMD" in md and "EVAL_CMD" in md and "test cpu" in md
  assert "0.123" in md and "0.456" in md  # table cells come from the JSON
  assert "direction reproduced" in md  # SP beats zero past the range in this synthetic data
  assert "Exact match (the whole copy right):" in md  # shown as a table when it is informative
  assert "| 512 | 4x | 0.250 | 0.250 | 0.250 |" in md
  assert ">= 0.9 at every length up to T=128 (1x)" in md
  assert "0.500 with the zero control vs 0.750 with state passing (state passing is ahead)" in md
  for name in ("copying_by_length.png", "passkey_heatmap.png"):
    assert f"(results/figures/{name})" in md
    assert os.path.getsize(os.path.join(figs, name)) > 1000
  assert copy_passkey.render(res, figs) == md  # deterministic
