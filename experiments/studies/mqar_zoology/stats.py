"""The MQAR Zoology study's statistics, from the sweeps' ``cells.json`` records
(experiments/studies/mqar_zoology_sweep.py).

Per (width, mixer): the learning rate with the best validation accuracy (mean over seeds and validation
cells, each cell weighted alike; the test split is never used to choose), then per test cell the mean over
seeds of that rate's accuracy (accuracy = the fraction of an example's queries whose value is recalled),
with a 95% interval from the crossed bootstrap over seeds x test examples
(experiments/evaluation/bootstrap.py). Per (width, test cell): kdn_diag - kda at their own best rates,
seeds paired by seed (the same data order) and examples by example, with the paired crossed bootstrap
interval, and the verdict read from that interval only (:func:`verdict`).
"""

from __future__ import annotations

import numpy as np

from experiments.evaluation import bootstrap

PAIRS = (("kdn_diag", "kda"),)
RESAMPLES = 2000


def verdict(lo: float, hi: float) -> str:
  """'ahead' when the whole interval of a - b is above 0, 'behind' when below, else 'tied'."""
  if lo > 0:
    return "ahead"
  if hi < 0:
    return "behind"
  return "tied"


def cell_key(t: int, n: int) -> str:
  return f"{t}x{n}"


def _accuracy(record: dict, split: str) -> dict[str, np.ndarray]:
  """{cell: float [members, examples]} per-example fraction of queries recalled."""
  return {
    cell_key(c["seq_len"], c["num_kv_pairs"]): np.asarray(c["correct"], np.float64)
    / c["num_kv_pairs"]
    for c in record[split]["cells"]
  }


def best_rate(record: dict) -> tuple[float, dict]:
  """(the rate with the best mean validation accuracy, {rate: that mean})."""
  val = _accuracy(record, "validation")
  per_member = np.mean([a.mean(axis=1) for a in val.values()], axis=0)  # [members]
  by_rate = {}
  for m, acc in zip(record["members"], per_member):
    by_rate.setdefault(m["learning_rate"], []).append(acc)
  means = {lr: float(np.mean(v)) for lr, v in by_rate.items()}
  return max(means, key=lambda lr: (means[lr], -lr)), means


def _seed_table(
  record: dict, lr: float, split: str = "test"
) -> tuple[list[int], dict[str, np.ndarray]]:
  """(seeds, {cell: [seeds, examples]}) of the members at rate ``lr``, ordered by seed."""
  rows = sorted((m["seed"], i) for i, m in enumerate(record["members"]) if m["learning_rate"] == lr)
  idx = [i for _, i in rows]
  return [s for s, _ in rows], {k: a[idx] for k, a in _accuracy(record, split).items()}


def analyse(records: dict, resamples: int = RESAMPLES, seed: int = 0) -> dict:
  """``records``: {(width, mixer): cells.json record} -> the study's tables (JSON-ready)."""
  mixers, cells_out, best = {}, {}, {}
  for (width, mixer), rec in sorted(records.items()):
    lr, val = best_rate(rec)
    seeds, table = _seed_table(rec, lr)
    key = f"d{width}/{mixer}"
    best[key] = {
      "learning_rate": lr,
      "validation_accuracy": val[lr],
      "validation_by_rate": [[r, a] for r, a in sorted(val.items())],
      "seeds": seeds,
      "diverged": [
        m["seed"] for m in rec["members"] if m["learning_rate"] == lr and m["status"] != "completed"
      ],
      "num_params": rec["num_params"],
      "step": rec["step"],
      "num_steps": rec["num_steps"],
    }
    rows = []
    for k, acc in table.items():
      iv = bootstrap.mean_crossed(acc, resamples=resamples, seed=seed)
      rows.append(
        {
          "cell": k,
          "mean": iv.estimate,
          "lo": iv.lo,
          "hi": iv.hi,
          "per_seed": acc.mean(axis=1).tolist(),
          "examples": acc.shape[1],
        }
      )
    cells_out[key] = rows
    mixers.setdefault(width, set()).add(mixer)
  comparisons = []
  for width in sorted(mixers):
    for a, b in PAIRS:
      if a not in mixers[width] or b not in mixers[width]:
        continue
      ra, rb = records[(width, a)], records[(width, b)]
      sa, ta = _seed_table(ra, best[f"d{width}/{a}"]["learning_rate"])
      sb, tb = _seed_table(rb, best[f"d{width}/{b}"]["learning_rate"])
      common = sorted(set(sa) & set(sb))
      if not common:
        continue
      rows = []
      for k in ta:
        if k not in tb:
          continue
        x = ta[k][[sa.index(s) for s in common]]
        y = tb[k][[sb.index(s) for s in common]]
        iv = bootstrap.paired_difference_crossed(x, y, resamples=resamples, seed=seed)
        rows.append(
          {
            "cell": k,
            "diff": iv.estimate,
            "lo": iv.lo,
            "hi": iv.hi,
            "verdict": verdict(iv.lo, iv.hi),
            "a": float(x.mean()),
            "b": float(y.mean()),
          }
        )
      comparisons.append({"width": width, "a": a, "b": b, "seeds": common, "cells": rows})
  return {
    "best": best,
    "cells": cells_out,
    "comparisons": comparisons,
    "resamples": resamples,
    "bootstrap_seed": seed,
    "level": bootstrap.LEVEL,
  }
