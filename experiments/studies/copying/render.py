"""RESULTS.md: the copying study (experiments/studies/copying/study.py) with seeds, paired intervals and
verdicts, from the per-run JSON under ``docs/results/copying/<preset>/`` (``--publish``).

Each run's JSON holds, per evaluated copy length L, every string's correct characters
teacher-forced and free-running (greedy; space-separated counts), on one set of strings shared by all runs (its hash in
``eval.hash``). Per (arm, size) the runs are: ``zero`` (trained from the zero state on L ~ U[50,
100]), ``sp`` (trained with state passing), ``zero+zero`` and ``zero+sp`` (the zero model
post-trained with the zero state, the control for the extra steps, and with state passing) and
``cap`` (the capacity control, trained on L ~ U[50, 300]). A run's table is seeds x strings of
character accuracy (correct / L); intervals are the crossed bootstrap (evaluation/bootstrap.py:
seeds and strings resampled independently) and comparisons are paired (seed i with seed i, string j
with string j).

Verdict rules, stated before the runs, each read at L = 300 (the paper's length) for teacher-forced
and free-running accuracy separately, and only where the zero run copies its training range
(character accuracy >= 0.9 at the longest evaluated L <= 100; else **not learnt**: the model did not
learn to copy from scratch, and the study says so instead of a verdict):
- **State passing ahead**: ``sp`` against ``zero``, and ``zero+sp`` against ``zero+zero`` (against
  ``zero`` where the post-training control is missing), is **ahead** when the 95% interval of the
  paired difference lies above 0, **behind** below 0, else **tied**.
- **Capacity or length**: with d = ``cap`` - ``zero`` (paired), the zero run's loss past 100 is a
  **length failure** when the interval of d lies above 0.2 (the capacity control copies L = 300 far
  better: the state can hold it, the zero-trained readout cannot use it), **capacity** when it lies
  below 0.2 (a model trained at L = 300 fails there too: state passing cannot help), else
  **undecided**; **no loss** when the zero run reads >= 0.9 at L = 300.

The paper (its Table 1, Mamba-2 45M at L = 300): 0.27 +- 0.03 from the zero state, 0.47 +- 0.11 with
state passing; ours beside it as the mean +- the standard deviation of the per-seed means.
"""

from __future__ import annotations

import os

import numpy as np

from experiments.evaluation import bootstrap
from experiments.studies.results import common

ROOT = "copying"
RUNS = ("zero", "sp", "zero+zero", "zero+sp", "cap")
MODES = {"teacher_forced": "teacher-forced", "free_running": "free-running"}
VERDICT_LEN = 300
LEARNT = 0.9  # the zero run's accuracy in its training range for verdicts to count
TRAIN_MAX = 100
FAR_BETTER = 0.2  # cap - zero at L = 300 above which the zero run's loss is a length failure
PAPER = {"zero": (0.27, 0.03), "sp": (0.47, 0.11)}  # Mamba-2 45M at L = 300
ARMS = ("mamba2", "kdn_diag")
SIZES = ("tiny", "5m", "15m", "45m")


def load_runs(folder: str) -> list[dict]:
  """The study's per-run JSON in ``folder`` (one evaluation set: the most common hash)."""
  return common.study_runs(folder, "copying")


def run_name(r: dict) -> str:
  if r["stage"] == "pretrain":
    return r["train"]
  return f"{r['train']}+{'sp' if r['stage'] == 'state_passing' else r['stage']}"


def table_of(runs, arm, size, name, length, mode):
  """[seeds, strings] character accuracy of one run name, and its seeds (ascending)."""
  rows = {}
  for r in runs:
    if (r["arm"], r["size"], run_name(r)) != (arm, size, name):
      continue
    for c in r["cells"]:
      if c["copy_len"] == length:
        rows[r["seed"]] = np.asarray(c[mode].split(), np.float64) / length
  seeds = sorted(rows)
  return (np.stack([rows[s] for s in seeds]) if seeds else None), seeds


def paired(runs, arm, size, a, b, length, mode, resamples=2000) -> dict | None:
  """The paired difference ``a`` - ``b`` over the seeds both have (None without any)."""
  x, sx = table_of(runs, arm, size, a, length, mode)
  y, sy = table_of(runs, arm, size, b, length, mode)
  shared = sorted(set(sx) & set(sy)) if x is not None and y is not None else []
  if not shared:
    return None
  xa, yb = x[[sx.index(s) for s in shared]], y[[sy.index(s) for s in shared]]
  d = bootstrap.paired_difference_crossed(xa, yb, resamples=resamples).to_json()
  return dict(d, seeds=shared)


def ahead(d: dict, margin: float = 0.0) -> str:
  return "ahead" if d["lo"] > margin else "behind" if d["hi"] < margin else "tied"


def learnt(runs, arm, size, mode) -> bool | None:
  """Whether the zero run copies its training range (None: not evaluated there)."""
  inside = sorted({c["copy_len"] for r in runs for c in r["cells"] if c["copy_len"] <= TRAIN_MAX})
  if not inside:
    return None
  x, _ = table_of(runs, arm, size, "zero", inside[-1], mode)
  return None if x is None else bool(x.mean() >= LEARNT)


def verdicts(runs, arm, size, mode, length=VERDICT_LEN, resamples=2000) -> dict:
  """{comparison: (its paired difference or None, the verdict)} by the module docstring's rules."""
  ok = learnt(runs, arm, size, mode)
  if not ok:
    why = "not learnt" if ok is False else "no zero run evaluated in its training range"
    return {"state passing": (None, why), "capacity": (None, why)}
  out = {}
  sp = paired(runs, arm, size, "sp", "zero", length, mode, resamples)
  out["sp - zero"] = (sp, ahead(sp) if sp else "missing")
  control = (
    "zero+zero" if table_of(runs, arm, size, "zero+zero", length, mode)[0] is not None else "zero"
  )
  post = paired(runs, arm, size, "zero+sp", control, length, mode, resamples)
  out[f"zero+sp - {control}"] = (post, ahead(post) if post else "missing")
  z, _ = table_of(runs, arm, size, "zero", length, mode)
  cap = paired(runs, arm, size, "cap", "zero", length, mode, resamples)
  if z is not None and z.mean() >= LEARNT:
    out["cap - zero"] = (cap, "no loss")
  elif cap is None:
    out["cap - zero"] = (None, "missing")
  else:
    call = {"ahead": "length failure", "behind": "capacity"}.get(
      ahead(cap, FAR_BETTER), "undecided"
    )
    out["cap - zero"] = (cap, call)
  return out


def shapes_of(runs) -> list[tuple[str, str]]:
  found = {(r["arm"], r["size"]) for r in runs}
  key = lambda s: (  # noqa: E731
    SIZES.index(s[1]) if s[1] in SIZES else len(SIZES),
    ARMS.index(s[0]) if s[0] in ARMS else len(ARMS),
    s,
  )
  return sorted(found, key=key)


def _spread(x) -> str:
  per_seed = x.mean(axis=1)
  spread = per_seed.std(ddof=1) if len(per_seed) > 1 else 0.0
  return f"{per_seed.mean():.2f} ± {spread:.2f}"


def render_tables(runs: list[dict], resamples: int = 2000) -> str:
  """Per (arm, size) and mode: character accuracy by L for every run (mean [95% interval] over
  seeds x strings), exact match at L = 300, the paper's line and the verdicts."""
  if not runs:
    return "No copying runs found."
  lengths = sorted({c["copy_len"] for r in runs for c in r["cells"]})
  out = []
  for arm, size in shapes_of(runs):
    mine = [r for r in runs if (r["arm"], r["size"]) == (arm, size)]
    n = mine[0].get("non_embedding_params")
    seeds = sorted({r["seed"] for r in mine})
    names = [x for x in RUNS if any(run_name(r) == x for r in mine)]
    out += [
      f"**{arm} {size}** ({common.short_count(n) if n else '?'} non-embedding parameters; seeds "
      f"{', '.join(map(str, seeds))}; {mine[0]['sequences']:,} training sequences; character "
      "accuracy, mean [95% interval] over seeds x strings)",
      "",
    ]
    for mode, label in MODES.items():
      header = [label] + [f"L={L}" + (" (trained)" if L <= TRAIN_MAX else "") for L in lengths]
      rows = []
      for name in names:
        row = [name]
        for L in lengths:
          x, _ = table_of(mine, arm, size, name, L, mode)
          row.append(
            common.interval(bootstrap.mean_crossed(x, resamples=resamples).to_json(), 2)
            if x is not None
            else ""
          )
        rows.append(row)
      out += [common.table(header, rows), ""]
      at = []
      for name in names:
        x, _ = table_of(mine, arm, size, name, VERDICT_LEN, mode)
        if x is not None:
          at.append(f"{name} {_spread(x)} (exact match {np.mean(x == 1):.2f})")
      if at:
        out += [
          f"At L={VERDICT_LEN}, mean ± spread over seeds: " + "; ".join(at) + ". The paper "
          f"(Mamba-2 45M): zero {PAPER['zero'][0]:.2f} ± {PAPER['zero'][1]:.2f}, state passing "
          f"{PAPER['sp'][0]:.2f} ± {PAPER['sp'][1]:.2f}.",
          "",
        ]
      parts = []
      for what, (d, call) in verdicts(mine, arm, size, mode, resamples=resamples).items():
        parts.append(f"{what} {common.interval(d, 2)}: {call}" if d else f"{what}: {call}")
      out += [f"Verdicts ({label}, L={VERDICT_LEN}): " + "; ".join(parts) + ".", ""]
  return "\n".join(out)


def figure(runs, arm, size, fig_dir, name, title) -> str:
  """Character accuracy by L per run, teacher-forced and free-running, mean over seeds x strings."""
  p = common.plt()
  lengths = sorted({c["copy_len"] for r in runs for c in r["cells"]})
  fig, axes = p.subplots(1, 2, figsize=(9, 3.4), squeeze=False)
  for ax, (mode, label) in zip(axes[0], MODES.items()):
    ax.axvspan(min(lengths), TRAIN_MAX, color="0.9")
    for run in RUNS:
      ys = [table_of(runs, arm, size, run, L, mode)[0] for L in lengths]
      pts = [(L, y.mean()) for L, y in zip(lengths, ys) if y is not None]
      if pts:
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1.3, label=run)
    ax.set(xlabel="copy length L", ylabel="character accuracy", ylim=(0, 1.02), title=label)
    ax.grid(alpha=0.3)
  axes[0][1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
  fig.suptitle(title, fontsize=10)
  return common.save(fig, fig_dir, name)


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, ROOT)
  if not common.exists(root):
    return ""
  presets = list(common.preset_runs(root, load_runs))
  if not presets:
    return ""
  rules = __doc__.split("Verdict rules, stated before the runs, ")[1].split("\n\nThe paper")[0]
  intro = (
    "The second paper's copying test at its scale: Mamba-2 (and kdn_diag at the same parameter "
    "count) learns to copy strings of 50-100 symbols from scratch, then copies up to 400, from the "
    "zero state, with state passing during training or as a post-training, and against a capacity "
    "control trained on 50-300. Verdict rules, stated before the runs, " + rules
  )
  out = ["## 4c. Copying at the paper's scale, with seeds", "", " ".join(intro.split()), ""]
  for preset, pdir, runs in presets:
    out += [f"### Preset `{preset}`", "", *common.commands_lines(pdir), render_tables(runs), ""]
    for arm, size in shapes_of(runs):
      title = f"copying study ({preset}), {arm} {size}: character accuracy, mean over seeds"
      path = figure(runs, arm, size, fig_dir, f"copying_study_{preset}_{arm}_{size}.png", title)
      out += [f"![{arm} {size}: character accuracy by copy length]({path})", ""]
  return "\n".join(out)
