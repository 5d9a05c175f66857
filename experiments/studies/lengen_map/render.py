"""RESULTS.md: the length-generalisation map (experiments/studies/lengen_map/study.py), from the
per-checkpoint JSON under ``docs/results (its lengen_map/<preset> folder)`` (``--publish``). Every interval is
recomputed here from the stored per-window band NLL (experiments/evaluation/band_ratio.py).

Rules, stated before the runs:

- A seed **fails** at a checkpoint when R = PPL[L/2, L) / min over the bands in [T/8, T) is >= 1.5
  with the lower end of its 95% interval >= 1.3. A cell (arm x size x T) **fails** when every one of
  its seeds (at least two) fails at its last checkpoint.
- **Trend**: R's factor per doubling of tokens per parameter, the least-squares slope of log R over
  a seed's checkpoints, with a bootstrap over windows paired across the checkpoints (they are scored
  on the same windows); a factor above 1 whose interval excludes 1 says R grows with training.
- **Fix** (post-training of a failing cell, one run per initial-state strategy and seed): **fix
  shown** when state_passing or tbtt brings R to <= 1.15 (its estimate) on every seed while the
  zero-state control still fails on every seed; **the control recovers** when the control itself no
  longer fails on some seed (post-training at a low rate, not the state, moved R); else **not
  shown**. Each intervention's in-range cost is its PPL over positions [0, T) over the control's,
  paired over windows.
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiments.evaluation import band_ratio
from experiments.studies.results import common

ROOT = "lengen_map"
FAIL_R, FAIL_LO, FIXED_R = 1.5, 1.3, 1.15
CONTROL = "zero"
FIXES = ("state_passing", "tbtt")
ARMS = ("mamba2_long", "mamba2", "gla", "kdn_diag")
SIZES = ("tiny", "500k", "2m", "8m")
COMMAND = "python -m experiments.studies.lengen_map --preset={preset} --results=<folder>"


def fails(ratio: dict) -> bool:
  return ratio["estimate"] >= FAIL_R and ratio["lo"] >= FAIL_LO


def load_runs(folder: str) -> list[dict]:
  if not os.path.isdir(folder):
    return []
  runs = [
    common.load(os.path.join(folder, f))
    for f in sorted(os.listdir(folder))
    if f.endswith(".json") and f not in ("commands.json", "throughput.json")
  ]
  runs = [r for r in runs if r.get("study") == ROOT]
  return sorted(runs, key=lambda r: (r["cell"], r["stage"] != "pretrain", r["stage"], r["step"]))


def _order(key):
  arm, size, t = key
  return (t, ARMS.index(arm) if arm in ARMS else 99, SIZES.index(size) if size in SIZES else 99)


def cells(runs) -> dict:
  """{(arm, size, T): {seed: {'pretrain': [runs by step], <strategy>: run}}}."""
  out: dict = {}
  for r in runs:
    seeds = out.setdefault((r["arm"], r["size"], r["train_len"]), {})
    by = seeds.setdefault(r["seed"], {"pretrain": []})
    if r["stage"] == "pretrain":
      by["pretrain"].append(r)
    else:
      by[r["stage"]] = r
  for seeds in out.values():
    for by in seeds.values():
      by["pretrain"].sort(key=lambda r: r["step"])
  return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _bands(r) -> np.ndarray:
  return np.asarray(r["band_nll"], np.float64)


def ratio_of(r, resamples=2000, seed=0) -> dict:
  return band_ratio.ratio(
    _bands(r), r["eval"]["band_edges"], r["train_len"], resamples=resamples, seed=seed
  )


def seed_trend(pre: list[dict], resamples=2000) -> dict | None:
  """R's factor per doubling of tokens per parameter over one seed's checkpoints (paired)."""
  pre = [r for r in pre if r["eval"]["hash"] == pre[-1]["eval"]["hash"]]
  if len(pre) < 2:
    return None
  x = [math.log2(r["tokens_per_param"]) for r in pre]
  return band_ratio.trend(
    [_bands(r) for r in pre], x, pre[0]["eval"]["band_edges"], pre[0]["train_len"],
    resamples=resamples,
  )  # fmt: skip


def cell_verdict(seeds: dict, resamples=2000) -> str:
  """'fails', 'passes' or 'incomplete' (fewer than two seeds, or seeds at other checkpoints)."""
  last = [by["pretrain"][-1] for by in seeds.values() if by["pretrain"]]
  if len(last) < 2 or len({r["step"] for r in last}) > 1:
    return "incomplete"
  return "fails" if all(fails(ratio_of(r, resamples)) for r in last) else "passes"


def fix_verdict(seeds: dict, resamples=2000) -> dict:
  """The fix rule over a failing cell's post-trainings: {'verdict', 'rows': per (strategy, seed)
  R and the in-range cost against the control}."""
  rows, ok = [], {}
  strategies = sorted({s for by in seeds.values() for s in by if s != "pretrain"})
  for strat in strategies:
    for seed, by in sorted(seeds.items()):
      if strat not in by:
        continue
      r = by[strat]
      row = {"strategy": strat, "seed": seed, "ratio": ratio_of(r, resamples)}
      ctrl = by.get(CONTROL)
      if ctrl is not None and strat != CONTROL and ctrl["eval"]["hash"] == r["eval"]["hash"]:
        row["cost"] = band_ratio.in_range_cost(
          _bands(ctrl), _bands(r), r["eval"]["band_edges"], r["train_len"], resamples=resamples
        )
      rows.append(row)
      ok.setdefault(strat, []).append(row["ratio"])
  n = len(seeds)
  control = ok.get(CONTROL, [])
  if len(control) < n or not control:
    verdict = "incomplete"
  elif not all(fails(r) for r in control):
    verdict = "the control recovers"
  elif any(len(ok.get(s, [])) == n and all(r["estimate"] <= FIXED_R for r in ok[s]) for s in FIXES):
    verdict = "fix shown"
  else:
    verdict = "not shown"
  return {"verdict": verdict, "rows": rows}


# ------------------------------------------------------------------------------------------ tables
def render_tables(runs: list[dict], resamples: int = 2000) -> str:
  if not runs:
    return "No lengen_map runs found."
  out = [
    "R = PPL[L/2, L) / min PPL over the bands in [T/8, T), 95% interval over windows, at each "
    "kept checkpoint (tokens per non-embedding parameter); trend = R's factor per doubling of "
    "tokens (paired over checkpoints).",
    "",
  ]
  rows = []
  by_cell = cells(runs)
  for (arm, size, t), seeds in by_cell.items():
    verdict = cell_verdict(seeds, resamples)
    for seed, by in sorted(seeds.items()):
      pre = by["pretrain"]
      if not pre:
        continue
      rs = [ratio_of(r, resamples) for r in pre]
      tr = seed_trend(pre, resamples)
      rows.append(
        [
          arm, size, t, seed,
          "; ".join(
            f"{r['tokens_per_param']:.3g}: {common.interval(x, 2)}" + (" ✗" if fails(x) else "")
            for r, x in zip(pre, rs)
          ),
          common.interval(tr, 3) if tr else "-",
          verdict,
        ]
      )  # fmt: skip
  out.append(common.table(["arm", "size", "T", "seed", "R by tokens/param", "trend", "cell"], rows))
  fix_rows = []
  for (arm, size, t), seeds in by_cell.items():
    if not any(len(by) > 1 for by in seeds.values()):
      continue
    fv = fix_verdict(seeds, resamples)
    for row in fv["rows"]:
      cost = row.get("cost")
      fix_rows.append(
        [
          f"{arm} {size} T={t}", row["strategy"], row["seed"], common.interval(row["ratio"], 2),
          common.interval(cost, 3) if cost else "-", fv["verdict"],
        ]
      )  # fmt: skip
  if fix_rows:
    out += [
      "",
      "Post-training of the failing cells (R after; in-range cost = PPL[0, T) / the control's):",
      "",
      common.table(["cell", "strategy", "seed", "R", "in-range cost", "verdict"], fix_rows),
    ]
  tau_rows = []
  for (arm, size, t), seeds in by_cell.items():
    last = [by["pretrain"][-1] for by in seeds.values() if by["pretrain"]]
    taus = np.concatenate(
      [np.asarray(lay["tau_median"]) for r in last for lay in r.get("time_constants", [])] or [[]]
    )
    if taus.size:
      tau_rows.append(
        [
          arm, size, t, len(taus), f"{np.median(taus):.3g}", f"{np.mean(taus > t):.2f}",
          f"{np.mean(taus > 8 * t):.2f}",
        ]
      )  # fmt: skip
  if tau_rows:
    out += [
      "",
      "Heads' time constants at zero input, 1 / (exp(A_log) softplus(dt_bias)) (median over a "
      "head's channels), at the last checkpoint over the seeds:",
      "",
      common.table(["arm", "size", "T", "heads", "median τ", "τ > T", "τ > 8T"], tau_rows),
    ]
  return "\n".join(out)


# ------------------------------------------------------------------------------------------ figures
def heatmap(runs, fig_dir, name, resamples=2000) -> str | None:
  """R (mean over seeds) by tokens/param x size, a panel per T x arm; failing seeds marked x."""
  by_cell = cells(runs)
  if not by_cell:
    return None
  ts = sorted({k[2] for k in by_cell})
  arms = [a for a in ARMS if any(k[0] == a for k in by_cell)] + sorted(
    {k[0] for k in by_cell} - set(ARMS)
  )
  sizes = [s for s in SIZES if any(k[1] == s for k in by_cell)]
  budgets = sorted({round(r["tokens_per_param"], 3) for r in runs if r["stage"] == "pretrain"})
  plt = common.plt()
  fig, axes = plt.subplots(
    len(ts), len(arms), figsize=(3.2 * len(arms), 2.4 * len(ts)), squeeze=False
  )
  for i, t in enumerate(ts):
    for j, arm in enumerate(arms):
      ax = axes[i][j]
      vals: dict = {}
      for si, size in enumerate(sizes):
        for by in by_cell.get((arm, size, t), {}).values():
          for r in by["pretrain"]:
            bj = budgets.index(round(r["tokens_per_param"], 3))
            iv = ratio_of(r, resamples)
            vals.setdefault((si, bj), []).append(iv["estimate"])
            if fails(iv):
              ax.text(bj, si, "×", ha="center", va="center", color="white", fontsize=12)
      grid = np.full((len(sizes), len(budgets)), np.nan)
      for (si, bj), v in vals.items():
        grid[si, bj] = np.mean(v)
      im = ax.imshow(grid, cmap="magma", vmin=0.8, vmax=2.0, aspect="auto", origin="lower")
      ax.set_xticks(range(len(budgets)), [f"{b:g}" for b in budgets], fontsize=7)
      ax.set_yticks(range(len(sizes)), sizes)
      ax.set_title(f"{arm}, T={t}", fontsize=9)
      if i == len(ts) - 1:
        ax.set_xlabel("tokens / parameter")
  fig.colorbar(im, ax=axes[-1][-1], label="R")
  return common.save(fig, fig_dir, name)


def ppl_curves(runs, fig_dir, name, resamples=2000) -> str | None:
  """PPL per doubling band with 95% bands: the failing cells' last checkpoints and their fixes
  (every cell's last checkpoint when none fails)."""
  by_cell = cells(runs)
  shown = [k for k, s in by_cell.items() if cell_verdict(s, resamples) == "fails"]
  shown = shown or list(by_cell)[:4]
  if not shown:
    return None
  plt = common.plt()
  fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3), squeeze=False)
  from experiments.evaluation import bootstrap  # pylint: disable=g-import-not-at-top

  for ax, key in zip(axes[0], shown):
    seeds = by_cell[key]
    seed = min(seeds)
    by = seeds[seed]
    for label, r in [("pretrain", by["pretrain"][-1])] + [
      (s, v) for s, v in sorted(by.items()) if s != "pretrain"
    ]:
      edges = r["eval"]["band_edges"]
      x = [max(a, 0.5) * (2 if a else 1) for a in edges[:-1]]
      iv = bootstrap.mean(_bands(r), resamples=resamples)
      ax.plot(x, np.exp(iv.estimate), label=label)
      ax.fill_between(x, np.exp(iv.lo), np.exp(iv.hi), alpha=0.2)
    ax.axvline(key[2], color="grey", ls=":")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{key[0]} {key[1]} T={key[2]} s{seed}", fontsize=9)
    ax.set_xlabel("position")
  axes[0][0].set_ylabel("PPL (band)")
  axes[0][-1].legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
  return common.save(fig, fig_dir, name)


def state_norms(runs, fig_dir, name) -> str | None:
  """Memory norm (mean over layers and heads) against t at every cell's last checkpoint, a panel
  per T x arm, a line per size."""
  by_cell = cells(runs)
  panels = sorted({(k[2], k[0]) for k in by_cell}, key=lambda p: (p[0], _order((p[1], "", 0))))
  if not panels:
    return None
  plt = common.plt()
  fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
  for ax, (t, arm) in zip(axes[0], panels):
    for (a, size, tt), seeds in by_cell.items():
      if (a, tt) != (arm, t):
        continue
      r = seeds[min(seeds)]["pretrain"][-1]
      sn = r["state_norm"]
      curve = [np.mean([np.mean(lay[k]) for lay in sn["layers"]]) for k in range(len(sn["t"]))]
      ax.plot(sn["t"], curve, marker=".", label=size)
    ax.axvline(t, color="grey", ls=":")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{arm}, T={t}", fontsize=9)
    ax.set_xlabel("t")
  axes[0][0].set_ylabel("memory norm")
  axes[0][-1].legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
  return common.save(fig, fig_dir, name)


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, ROOT)
  if not os.path.isdir(root):
    return ""
  parts = ["## 3d. Where length generalisation fails: the map\n"]
  for preset, pdir, runs in common.preset_runs(root, load_runs):
    parts += [f"### Preset {preset}", ""]
    parts += common.commands_lines(pdir) or [f"Command: `{COMMAND.format(preset=preset)}`", ""]
    for title, fn in (("R by tokens/param", heatmap), ("PPL by band", ppl_curves)):
      path = fn(runs, fig_dir, f"lengen_map_{preset}_{fn.__name__}.png")
      if path:
        parts += [f"![{title}]({path})", ""]
    path = state_norms(runs, fig_dir, f"lengen_map_{preset}_state_norms.png")
    if path:
      parts += [f"![state norms]({path})", ""]
    parts += [render_tables(runs), ""]
  return "\n".join(parts)
