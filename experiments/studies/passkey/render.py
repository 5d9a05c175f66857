"""RESULTS.md: the passkey study (experiments/studies/passkey/study.py) with seeds, paired intervals and
verdicts, from the per-run JSON under ``docs/results/passkey/<preset>/`` (``--publish``).

Each run's JSON holds, per (length, depth) cell, every example's exact match on one evaluation set
shared by all runs (its hash in ``eval.hash``). A mixer's runs form a table per arm: seeds x
examples. Intervals are the crossed bootstrap (evaluation/bootstrap.py: seeds and examples
resampled independently); an intervention is compared with the zero-state control of the same seeds
on the same examples (the paired difference of the two tables).

Verdict rule, stated before the runs: at a length L past the training length T, an intervention is
**ahead** of the control when the 95% interval of the paired difference in exact match lies above 0
(**behind** below 0, else **tied**), read at depth 1 (the key just before the query, so that decay
over the distance cannot explain a miss); the **fix is shown** for a mixer when an intervention is
ahead at >= 2 lengths past T where the control's exact match is below 0.9.
"""

from __future__ import annotations

import os

import numpy as np

from experiments.evaluation import bootstrap
from experiments.studies.results import common

MIXERS = ("gla", "kdn_diag", "kdn_iso", "kda", "gated_deltanet", "mamba2", "mamba2_official")
CONTROL = "zero"
FIX_BELOW = 0.9  # the control's exact match under which a repair counts
FIX_LENGTHS = 2  # lengths past T where the intervention must be ahead
VERDICT_DEPTH = 1.0
ROOT = "passkey"


def load_runs(folder: str) -> list[dict]:
  """The study's per-run JSON in ``folder`` (one evaluation set: the most common hash)."""
  return common.study_runs(folder, "passkey")


def arm_name(r: dict) -> str:
  return "pretrain" if r["stage"] == "pretrain" else r["strategy"]


def _table(runs: list[dict], mixer: str, arm: str, length: int, depth: float):
  """[seeds, examples] exact match (0/1) and the seeds, ordered by seed."""
  rows = {}
  for r in runs:
    if r["mixer"] != mixer or arm_name(r) != arm:
      continue
    for c in r["cells"]:
      if c["length"] == length and c["depth"] == depth:
        rows[r["seed"]] = np.array([ch == "1" for ch in c["exact"]], np.float64)
  seeds = sorted(rows)
  return (np.stack([rows[s] for s in seeds]) if seeds else None), seeds


def arms_of(runs, mixer) -> list[str]:
  found = {arm_name(r) for r in runs if r["mixer"] == mixer}
  order = ["pretrain", CONTROL]
  return [a for a in order if a in found] + sorted(found - set(order))


def mixers_of(runs) -> list[str]:
  found = {r["mixer"] for r in runs}
  return [m for m in MIXERS if m in found] + sorted(found - set(MIXERS))


def compare(runs, mixer, arm, lengths, depth=VERDICT_DEPTH, resamples=2000) -> dict:
  """Per length: the arm's mean with its interval, the paired difference to the control and its
  verdict (seeds both arms share)."""
  out = {}
  for length in lengths:
    x, sx = _table(runs, mixer, arm, length, depth)
    c, sc = _table(runs, mixer, CONTROL, length, depth)
    if x is None:
      continue
    row = {"mean": bootstrap.mean_crossed(x, resamples=resamples).to_json(), "seeds": sx}
    shared = sorted(set(sx) & set(sc))
    if c is not None and shared and arm != CONTROL:
      a = x[[sx.index(s) for s in shared]]
      b = c[[sc.index(s) for s in shared]]
      d = bootstrap.paired_difference_crossed(a, b, resamples=resamples).to_json()
      row["diff"] = d
      row["control"] = float(b.mean())
      row["verdict"] = "ahead" if d["lo"] > 0 else "behind" if d["hi"] < 0 else "tied"
    out[length] = row
  return out


def _mean(row: dict) -> float:
  return row["mean"]["estimate"]


def fix_shown(cmp: dict, train_len: int) -> bool:
  ahead = [
    L
    for L, row in cmp.items()
    if L > train_len and row.get("verdict") == "ahead" and row["control"] < FIX_BELOW
  ]
  return len(ahead) >= FIX_LENGTHS


def _per_seed(runs, mixer, arm, length) -> dict:
  x, seeds = _table(runs, mixer, arm, length, VERDICT_DEPTH)
  return {} if x is None else dict(zip(seeds, x.mean(axis=1)))


def seed_repairs(runs, mixer, train_len, longest) -> str:
  """A description beside the verdict (not part of its rule): which seeds' controls learned the
  task in range (>= FIX_BELOW at T) but fail at the longest length, and how many of those each
  intervention brings to >= FIX_BELOW there; seeds that never learned it are named apart."""
  at_t, at_long = (_per_seed(runs, mixer, CONTROL, L) for L in (train_len, longest))
  seeds = sorted(set(at_t) & set(at_long))
  if not seeds:
    return ""
  failing = [s for s in seeds if at_t[s] >= FIX_BELOW and at_long[s] < FIX_BELOW]
  unlearned = [s for s in seeds if at_t[s] < FIX_BELOW]
  names = lambda xs: ", ".join(map(str, xs)) or "none"  # noqa: E731
  parts = [
    f"Seeds whose control reads the key at T but not at {longest}: {names(failing)} "
    f"({len(failing)} of {len(seeds)}; never learned in range: {names(unlearned)})"
  ]
  for arm in arms_of(runs, mixer) if failing else ():
    if arm not in ("pretrain", CONTROL):
      got = _per_seed(runs, mixer, arm, longest)
      fixed = sum(got.get(s, 0.0) >= FIX_BELOW for s in failing)
      parts.append(f"{arm} brings {fixed} of them to >= {FIX_BELOW:g}")
  return "; ".join(parts) + " (a description beside the verdict, not its rule)."


def render_tables(runs: list[dict], resamples: int = 2000) -> str:
  """Per mixer: exact match at depth 1 by length for every arm (mean [95% interval] over seeds x
  examples), the paired difference to the control with its verdict, and the mixer's verdict."""
  if not runs:
    return "No passkey runs found."
  lengths = sorted({c["length"] for r in runs for c in r["cells"]})
  train_len = runs[0]["train_len"]
  out = []
  for mixer in mixers_of(runs):
    seeds = sorted({r["seed"] for r in runs if r["mixer"] == mixer})
    out += [
      f"**{mixer}** (seeds {', '.join(map(str, seeds))}; exact match with the key just before "
      f"the query, mean [95% interval] over seeds x examples; Δ: paired difference to the zero "
      f"control)",
      "",
    ]
    header = ["arm"] + [f"{L}" + (" (T)" if L == train_len else "") for L in lengths]
    rows, fixes = [], []
    for arm in arms_of(runs, mixer):
      cmp = compare(runs, mixer, arm, lengths, resamples=resamples)
      rows.append([arm] + [common.interval(cmp[L]["mean"], 2) if L in cmp else "" for L in lengths])
      if arm not in ("pretrain", CONTROL):
        rows.append(
          [f"Δ {arm}"]
          + [
            f"{common.interval(cmp[L]['diff'], 2)} {cmp[L]['verdict']}"
            if L in cmp and "diff" in cmp[L]
            else ""
            for L in lengths
          ]
        )
        if fix_shown(cmp, train_len):
          fixes.append(arm)
    out += [common.table(header, rows), ""]
    longest = max(lengths)
    per_seed = []
    for arm in arms_of(runs, mixer):
      x, sx = _table(runs, mixer, arm, longest, VERDICT_DEPTH)
      if x is not None:
        per_seed.append(f"{arm} " + " / ".join(f"{v:.2f}" for v in x.mean(axis=1)))
    out += [
      f"Per seed ({', '.join(map(str, seeds))}) at {longest}: " + "; ".join(per_seed) + ".",
      "",
    ]
    repairs = seed_repairs(runs, mixer, train_len, longest)
    if repairs:
      out += [repairs, ""]
    control = compare(runs, mixer, CONTROL, lengths, resamples=resamples)
    failing = [
      L for L in lengths if L > train_len and L in control and _mean(control[L]) < FIX_BELOW
    ]
    if fixes:
      verdict = f"fix shown by {', '.join(fixes)}"
    elif not failing:
      verdict = (
        f"no failure to repair (the zero control reads >= {FIX_BELOW:g} at every length past T)"
      )
    else:
      verdict = (
        f"no fix shown (the control is below {FIX_BELOW:g} at {', '.join(map(str, failing))}; no "
        "intervention is ahead there at >= 2 lengths)"
      )
    out += [f"Verdict for {mixer}: {verdict}.", ""]
  return "\n".join(out)


def heatmap(runs, mixer, fig_dir, name, title) -> str:
  """Exact match over length x depth per arm (mean over seeds and examples), and each
  intervention's difference to the control."""
  p = common.plt()
  arms = arms_of(runs, mixer)
  lengths = sorted({c["length"] for r in runs for c in r["cells"]})
  depths = sorted({c["depth"] for r in runs for c in r["cells"]})

  def grid(arm):
    g = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
      for j, L in enumerate(lengths):
        x, _ = _table(runs, mixer, arm, L, d)
        if x is not None:
          g[i, j] = x.mean()
    return g

  grids = {a: grid(a) for a in arms}
  diffs = {
    a: grids[a] - grids[CONTROL]
    for a in arms
    if a not in ("pretrain", CONTROL) and CONTROL in grids
  }
  panels = [(a, grids[a], "viridis", (0, 1)) for a in arms] + [
    (f"{a} - {CONTROL}", g, "RdBu", (-1, 1)) for a, g in diffs.items()
  ]
  fig, axes = p.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
  for ax, (label, g, cmap, (lo, hi)) in zip(axes[0], panels):
    im = ax.imshow(g, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", origin="lower")
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=90, fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    ax.set_xlabel("length")
    ax.set_ylabel("key depth")
    ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
  fig.suptitle(title, fontsize=10)
  return common.save(fig, fig_dir, name)


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, ROOT)
  if not common.exists(root):
    return ""
  intro = (
    "The second paper's claim on retrieval: a model trained from the zero state reads its state "
    "badly once it is longer than any seen in training, and post-training from realistic states "
    "(State Passing, noise fitted to the states) repairs it. Design: each mixer pretrained at T=128 "
    "from the zero state with several seeds, each checkpoint post-trained with the zero state (the "
    "control) and with each intervention, every run scored from the zero state on the same "
    "examples. Verdict rule, stated before the runs: "
    + __doc__.split("Verdict rule, stated before the runs: ")[1].split("\n\n")[0]
  )
  out = ["## 4b. Passkey past the training length, with seeds", "", " ".join(intro.split()), ""]
  for preset, pdir, runs in common.preset_runs(root, load_runs):
    out += [f"### Preset `{preset}`", "", *common.commands_lines(pdir), render_tables(runs), ""]
    for mixer in mixers_of(runs):
      title = f"passkey study ({preset}), {mixer}: exact match, mean over seeds"
      path = heatmap(runs, mixer, fig_dir, f"passkey_study_{preset}_{mixer}.png", title)
      out += [f"![{mixer}: exact match by length and depth]({path})", ""]
  return "\n".join(out)
