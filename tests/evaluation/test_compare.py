"""experiments.compare on constructed evaluation JSON: the paired difference where the runs scored
the same examples, the unpaired one where not (said so), the overlay PNG and one-line errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import compare
from experiments.evaluation import bootstrap

CENTERS = [1.0, 3.5, 12.5, 48.5, 192.5]


def _write(folder, per_window, examples="abc", step=7, suite="position_ppl"):
  os.makedirs(folder, exist_ok=True)
  per_window = np.asarray(per_window)
  res = {
    "max_len": 256,
    "sequences": len(per_window),
    "train_len": 32,
    "bucket_center": CENTERS,
    "bucket_ppl": np.exp(per_window.mean(0)).tolist(),
    "bucket_nll_per_sequence": per_window.tolist(),
    "meta": {"workdir": folder.split("/eval")[0], "step": step, "settings": {"seed": 0}},
  }
  if examples is not None:
    res["examples_hash"] = examples
  with open(os.path.join(folder, f"{suite}.json"), "w", encoding="utf-8") as f:
    json.dump(res, f)
  return res


def _windows(seed, n=12, shift=0.0):
  """Per-window bucket NLLs whose windows differ a lot from each other (shared between runs of
  the same seed), with a small per-run noise."""
  rng = np.random.default_rng(seed)
  window = rng.normal(0, 0.5, (n, 1))  # hard and easy windows: the spread pairing removes
  return 3.0 + window + np.linspace(0, -0.5, len(CENTERS)) + shift


def test_paired_difference_where_the_runs_share_examples(tmp_path):
  base = _windows(0)
  post = base + 0.1 + np.random.default_rng(1).normal(0, 0.01, base.shape)
  _write(str(tmp_path / "a" / "eval"), base)
  _write(str(tmp_path / "b" / "eval" / "step3"), base + 5)  # older: not read
  _write(str(tmp_path / "b" / "eval" / "step10"), post, step=10)
  _write(str(tmp_path / "c" / "eval"), _windows(2, n=10, shift=0.1), examples="other")
  evs = compare.load_runs([str(tmp_path / r) for r in "abc"], "position_ppl")
  assert [e.label for e in evs] == ["a@7", "b@10", "c@7"]
  curve = compare.SUITES["position_ppl"]
  paired, how = compare.difference(evs[1], evs[0], curve, 1000, 0)
  assert how == "paired over 12 shared examples"
  np.testing.assert_allclose(paired.estimate, (post - base).mean(0))
  assert (
    np.all(paired.lo < 0.1) and np.all(paired.hi > 0.1) and np.all(paired.hi - paired.lo < 0.03)
  )
  # the same numbers with the pairing ignored: the windows' spread widens the interval
  unpaired = bootstrap.unpaired_difference(post, base, resamples=1000)
  np.testing.assert_allclose(unpaired.estimate, paired.estimate)
  assert np.all(unpaired.hi - unpaired.lo > 10 * (paired.hi - paired.lo))
  other, how = compare.difference(evs[2], evs[0], curve, 1000, 0)
  assert how == "unpaired: other examples (10 vs 12 units)" and other.units == (10, 12)
  text, out = compare.compare_suite(evs, "position_ppl", 1000, 0)
  assert "- b@10 − a@7: paired over 12 shared examples" in text
  assert "- c@7 − a@7: unpaired: other examples" in text
  row = next(line for line in text.splitlines() if line.startswith("| 12.5 |"))
  assert f"{paired.estimate[2]:+.3f} [{paired.lo[2]:+.3f}, {paired.hi[2]:+.3f}] *" in row
  assert out["differences"]["b@10"]["units"] == 12


def test_json_without_hash_or_units_is_unpaired_or_not_differenced(tmp_path):
  _write(str(tmp_path / "a"), _windows(0))
  _write(str(tmp_path / "b"), _windows(0, shift=0.2), examples=None)
  res = _write(str(tmp_path / "c"), _windows(0))
  del res["bucket_nll_per_sequence"]
  res["bucket_ppl_lo"], res["bucket_ppl_hi"] = res["bucket_ppl"], res["bucket_ppl"]
  (tmp_path / "c" / "position_ppl.json").write_text(json.dumps(res))
  evs = compare.load_runs([str(tmp_path / r) for r in "abc"], "position_ppl")
  curve = compare.SUITES["position_ppl"]
  assert compare.difference(evs[1], evs[0], curve, 200, 0)[1] == (
    "unpaired: no examples_hash in a JSON"
  )
  iv, how = compare.difference(evs[2], evs[0], curve, 200, 0)
  assert iv is None and how.startswith("n/a: c@7's JSON has no per-unit values")


def test_main_writes_the_overlay_and_one_line_errors(tmp_path, capsys):
  _write(str(tmp_path / "a"), _windows(0))
  _write(str(tmp_path / "b"), _windows(0, shift=0.1))
  out = str(tmp_path / "out")
  compare.FLAGS(["compare", f"--out={out}", "--resamples=200"])
  assert compare.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
  assert os.path.getsize(os.path.join(out, "position_ppl.png")) > 1000
  assert "paired over 12 shared examples" in capsys.readouterr().out
  assert compare.main(["compare", str(tmp_path / "a")]) == 2
  assert compare.main(["compare", str(tmp_path / "a"), str(tmp_path / "none")]) == 2
  err = capsys.readouterr().err.splitlines()
  assert err[0] == "compare error: RUN: give at least two runs to compare, got 1"
  assert err[1].startswith("compare error: RUN: ") and "is not a folder" in err[1]
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match=r"no effrem.json in .*evaluate it first"):
    compare.find_eval(str(tmp_path / "empty"), "effrem")
  with pytest.raises(ValueError, match="--suite"):
    compare.check_args(["a", "b"], ["ppl"], 200)
  compare.FLAGS.unparse_flags()
