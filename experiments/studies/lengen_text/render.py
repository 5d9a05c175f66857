"""RESULTS.md: length generalisation on text at a short context, from docs/results/lengen_text/
<preset>/*.json (one JSON per evaluated run, written by experiments/studies/lengen_text/study.py).

Verdicts, computed here from the JSON:
  failure shown  a zero-state pretrained checkpoint's PPL@128T / PPL@T >= 1.5 with the 95%
                 interval's lower end >= 1.3;
  fix shown      a post-training strategy (state passing, TBTT; fitted / random noise reported the
                 same way) brings the ratio to <= 1.15 while the zero-state post-training control
                 stays >= 1.4, with in-range validation PPL within 3% of the control's.
"""

from __future__ import annotations

import glob
import os

from experiments.runner import plot_style
from experiments.studies.results import common

STAGES = ("pretrain", "zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
FIXES = ("state_passing", "tbtt")
FAIL_RATIO, FAIL_LO = 1.5, 1.3
FIX_RATIO, CONTROL_RATIO, VAL_TOLERANCE = 1.15, 1.4, 0.03
PRESET_TITLE = {
  "tiny": "tiny preset (CPU, a generated toy corpus: checks the pipeline, not the claim)",
  "t64": "T = 64 (GPU: 4 layers, d=256, 4 heads x 64, 16k vocabulary, ~7.8M parameters)",
  "t128": "T = 128 (GPU: the T = 64 model at batch 128)",
}
IN_DOMAIN_SUFFIX = "_long_val"  # experiments/studies/lengen_text/study.py LONG_SPLITS
# The second paper's findings beside ours (its reported settings, not numbers we measured).
PAPER = {
  "mamba2": "fails past T (Mamba-1/2)",
  "mamba2_long": "fails past T (Mamba-1/2)",
  "mamba2_normalized": "fails past T (Mamba-1/2)",
  "gla": "fails past T (GLA at T=512)",
  "kda": "not studied (no delta-rule model failed there)",
  "kdn_diag": "not studied",
}
PAPER_FIX = {
  "zero": "control",
  "state_passing": "fixes it (~0.1% of the pretraining budget)",
  "tbtt": "fixes it (~0.1% of the pretraining budget)",
  "fitted_noise": "helps sometimes",
  "random_noise": "the baseline of fitted noise",
}
CLAIM = (
  "Paper: a recurrent LM trained from the zero state at length T breaks past T (position-wise "
  "perplexity climbs), more so with more training tokens; State Passing / TBTT post-training "
  "fixes it."
)


def title(folder: str) -> str:
  """A results folder's heading: its preset and the long documents it was evaluated on."""
  base = folder.removesuffix(IN_DOMAIN_SUFFIX)
  where = (
    "in-domain long documents held out of train (long_val)"
    if folder.endswith(IN_DOMAIN_SUFFIX)
    else "the long_eval split (on the prepared corpus: Shakespeare and Austen, sources outside "
    "the training domain)"
  )
  return f"{PRESET_TITLE.get(base, base)}; evaluated on {where}"


def load_runs(preset_dir: str) -> list[dict]:
  """The study's per-run JSON of one preset folder, ordered by arm, stage and step."""
  runs = [common.load(p) for p in glob.glob(os.path.join(preset_dir, "*.json"))]
  runs = [r for r in runs if isinstance(r, dict) and r.get("study") == "lengen_text"]
  return sorted(
    runs,
    key=lambda r: (r["arm"], STAGES.index(r["stage"]) if r["stage"] in STAGES else 99, r["step"]),
  )


def _label(r: dict) -> str:
  return (
    f"pretrained, step {r['step']}" if r["stage"] == "pretrain" else f"+{r['step']} {r['stage']}"
  )


def failure_shown(r: dict) -> bool:
  return r["ratio"]["estimate"] >= FAIL_RATIO and r["ratio"]["lo"] >= FAIL_LO


def fix_shown(r: dict, control: dict | None) -> bool:
  return (
    control is not None
    and r["ratio"]["estimate"] <= FIX_RATIO
    and control["ratio"]["estimate"] >= CONTROL_RATIO
    and abs(r["val_ppl"] / control["val_ppl"] - 1) <= VAL_TOLERANCE
  )


def _control(runs, arm):
  return next((r for r in runs if r["arm"] == arm and r["stage"] == "zero"), None)


def _verdict(r: dict, runs: list[dict]) -> str:
  if r["stage"] == "pretrain":
    return "failure shown" if failure_shown(r) else "no failure"
  if r["stage"] == "zero":
    return "control"
  return _fix_words(r, _control(runs, r["arm"]))


def _fix_words(r: dict, control: dict | None) -> str:
  if fix_shown(r, control):
    return "fix shown"
  if control is not None and control["ratio"]["estimate"] < CONTROL_RATIO:
    return f"no fix shown (control below {CONTROL_RATIO}: nothing to fix)"
  return "no fix shown"


def drift(r: dict) -> tuple[float, int] | None:
  """PPL@L over the lowest PPL@n past T (2T <= n < L, the doubling bands of ``ppl_at``) and that
  n: how far the curve climbs back from its best point past T (1.0 when it keeps falling). A
  description beside the verdict, without an interval; None when fewer than two bands are
  stored."""
  at = {int(k): v for k, v in r["position"]["ppl_at"].items()}
  T, L = r["ratio"]["train_len"], r["ratio"]["long_len"]
  past = {n: v for n, v in at.items() if 2 * T <= n < L}
  if not past or L not in at:
    return None
  n = min(past, key=past.get)
  return at[L] / min(past[n], at[L]), n


def _drift_cell(r: dict) -> str:
  d = drift(r)
  return "" if d is None else f"{d[0]:.3f} (from {d[1]})"


def render_table(runs: list[dict]) -> str:
  rows = []
  for r in runs:
    T, L = r["ratio"]["train_len"], r["ratio"]["long_len"]
    at = r["position"]["ppl_at"]
    mid = r["effrem"]["mean"][len(r["effrem"]["mean"]) // 2]
    paper = PAPER.get(r["arm"], "") if r["stage"] == "pretrain" else PAPER_FIX.get(r["stage"], "")
    rows.append(
      [
        r["arm"],
        _label(r),
        common.short_count(r["tokens"]),
        f"{r['val_ppl']:.2f}",
        f"{at[str(T)]:.2f}",
        f"{at[str(L)]:.2f}",
        common.interval(r["ratio"]),
        _drift_cell(r),
        f"{mid:.3f}",
        _verdict(r, runs),
        paper,
      ]
    )
  T = runs[0]["ratio"]["train_len"] if runs else "T"
  L = runs[0]["ratio"]["long_len"] if runs else "128T"
  return common.table(
    [
      "arm",
      "run",
      "tokens",
      "val PPL",
      f"PPL@{T}",
      f"PPL@{L}",
      f"PPL@{L} / PPL@{T} [95% interval]",
      f"PPL@{L} / lowest PPL@n past T",
      f"EffRem({runs[0]['effrem']['T'] // 2 if runs else 'T/2'})",
      "verdict",
      "paper",
    ],
    rows,
  )


def verdicts(runs: list[dict]) -> list[str]:
  """One line per arm: the failure rule on its pretraining checkpoints, the fix rule on each
  post-training strategy against the zero control."""
  out = []
  for arm in sorted({r["arm"] for r in runs}):
    mine = [r for r in runs if r["arm"] == arm]
    pre = [r for r in mine if r["stage"] == "pretrain"]
    shown = [r for r in pre if failure_shown(r)]
    line = f"- **{arm}**: "
    if not pre:
      line += "no pretrained checkpoint evaluated"
    elif shown:
      line += "**failure shown** at step(s) " + ", ".join(
        f"{r['step']} ({common.interval(r['ratio'])})" for r in shown
      )
    else:
      worst = max(pre, key=lambda r: r["ratio"]["estimate"])
      line += (
        f"no failure (largest ratio {common.interval(worst['ratio'])} at step {worst['step']}; "
        f"the rule needs >= {FAIL_RATIO} with the lower end >= {FAIL_LO})"
      )
    control = _control(runs, arm)
    posts = [r for r in mine if r["stage"] not in ("pretrain", "zero")]
    if posts and control is None:
      line += "; no zero-state control evaluated, so no fix verdict"
    elif posts:
      parts = []
      for r in posts:
        dv = 100 * (r["val_ppl"] / control["val_ppl"] - 1)
        words = "**fix shown**" if fix_shown(r, control) else _fix_words(r, control)
        ratio = common.interval(r["ratio"])
        parts.append(f"{r['stage']} {words} (ratio {ratio}, val PPL {dv:+.1f}% vs control)")
      line += f"; control ratio {common.interval(control['ratio'])}: " + "; ".join(parts)
    out.append(line)
  return out


def domain_gap(runs: list[dict]) -> str:
  """How the long-eval documents compare with the training distribution at the same positions:
  PPL@T on the long-eval windows over the validation PPL (windows of T from the training
  sources), per arm at its last pretraining checkpoint. Far above 1, the long documents are out
  of the training domain, and what the model learns in context over them lowers PPL(t) at every
  length, which can hide a drift of the state."""
  parts = []
  for arm in sorted({r["arm"] for r in runs}):
    pre = [r for r in runs if r["arm"] == arm and r["stage"] == "pretrain"]
    if not pre:
      continue
    last = max(pre, key=lambda r: r["step"])
    T = last["ratio"]["train_len"]
    parts.append(f"{arm} {last['position']['ppl_at'][str(T)] / last['val_ppl']:.1f}x")
  if not parts:
    return ""
  return (
    "Long-eval PPL@T over validation PPL at the last pretraining checkpoint: "
    + ", ".join(parts)
    + ". Where this is far above 1 the long-eval documents lie outside the training domain; "
    "in-context adaptation then lowers PPL(t) at every length and can mask a drift of the "
    "state. The column PPL@L / lowest PPL@n past T shows how far each curve climbs back from "
    "its lowest band (1.000: it keeps falling)."
  )


def figure(runs: list[dict], arm: str, fig_dir: str, name: str) -> str:
  """Position-wise PPL with its band per run, and the ratio over pretraining tokens (Fig. 3)."""
  p = common.plt()
  fig, (a1, a2) = p.subplots(1, 2, figsize=(12, 4.2))
  # pretraining checkpoints in training order, then the post-trained runs (dashed): with many curves
  # the colours run along a colour map in that order
  mine = sorted(
    (r for r in runs if r["arm"] == arm), key=lambda r: (r["stage"] != "pretrain", r["tokens"])
  )
  colors = plot_style.curve_colors(len(mine))
  for r, color in zip(mine, colors):
    pos = r["position"]
    a1.plot(
      pos["bucket_center"],
      pos["bucket_ppl"],
      lw=1.2,
      color=color,
      ls="-" if r["stage"] == "pretrain" else "--",
      label=_label(r),
    )
    a1.fill_between(
      pos["bucket_center"], pos["bucket_ppl_lo"], pos["bucket_ppl_hi"], color=color, alpha=0.15
    )
  T = mine[0]["ratio"]["train_len"]
  a1.axvline(T, color="k", ls="--", lw=1)
  a1.set(
    xscale="log",
    yscale="log",
    xlabel="position t",
    ylabel="PPL(t), 95% band over windows",
    title=f"{arm}: position-wise perplexity (T = {T} dashed)",
  )
  pre = [r for r in mine if r["stage"] == "pretrain"]
  if pre:
    x = [r["tokens"] for r in pre]
    y = [r["ratio"]["estimate"] for r in pre]
    err = [
      [v - r["ratio"]["lo"] for v, r in zip(y, pre)],
      [r["ratio"]["hi"] - v for v, r in zip(y, pre)],
    ]
    a2.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label="pretrained (zero state)")
  for r, color in zip(mine, colors):  # the post-trained runs in their colours of the left panel
    if r["stage"] != "pretrain":
      a2.errorbar(
        [r["tokens"]],
        [r["ratio"]["estimate"]],
        yerr=[
          [r["ratio"]["estimate"] - r["ratio"]["lo"]],
          [r["ratio"]["hi"] - r["ratio"]["estimate"]],
        ],
        fmt="s",
        capsize=3,
        color=color,
        label=_label(r),
      )
  a2.axhline(FAIL_RATIO, color="r", ls=":", lw=1, label=f"failure rule {FAIL_RATIO}")
  a2.axhline(FIX_RATIO, color="g", ls=":", lw=1, label=f"fix rule {FIX_RATIO}")
  L = mine[0]["ratio"]["long_len"]
  a2.set(
    xscale="log",
    xlabel="training tokens",
    ylabel=f"PPL@{L} / PPL@{T}",
    title="the ratio with training tokens (paper Fig. 3: grows)",
  )
  for a in (a1, a2):
    a.grid(alpha=0.3, which="both")
    plot_style.legend_outside(a, fontsize=6)
  plot_style.plain_log_ticks(a1)
  plot_style.plain_log_ticks(a1, "x", minor=False)
  plot_style.plain_log_ticks(a2, "x", minor=False)
  fig.suptitle(CLAIM, fontsize=7)
  return common.save(fig, fig_dir, name)


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, "lengen_text")
  if not common.exists(root):
    return ""
  out = [
    "## 3c. Length generalisation on text at a short context",
    "",
    CLAIM,
    "",
    "Small LMs (`configs/lengen_short.py`) pretrained from the zero state at a short T, each kept "
    "checkpoint evaluated, then post-trained with each initial-state strategy "
    "(`python -m experiments.studies.lengen_text`). PPL@n = exp(mean NLL over positions [n/2, n)) "
    "on long-eval windows spread over the documents, state carried; intervals are 95% bootstrap "
    "intervals over the windows. **Failure shown**: a pretrained ratio PPL@128T / PPL@T >= "
    f"{FAIL_RATIO} with its lower end >= {FAIL_LO}. **Fix shown**: state passing or TBTT bring it to "
    f"<= {FIX_RATIO} while the zero-state post-training control stays >= {CONTROL_RATIO}, with "
    f"validation PPL within {100 * VAL_TOLERANCE:.0f}% of the control's (fitted / random noise are "
    "judged by the same rule).",
    "",
  ]
  for preset, pdir, runs in common.preset_runs(root, load_runs):
    out += [f"### {title(preset)}", "", *common.commands_lines(pdir)]
    train_s = sum(r.get("train_wall_s") or 0 for r in runs if r["stage"] != "pretrain")
    train_s += sum(
      max((r.get("train_wall_s") or 0) for r in runs if r["arm"] == a and r["stage"] == "pretrain")
      for a in {r["arm"] for r in runs if r["stage"] == "pretrain"}
    )
    eval_s = sum(r.get("eval_wall_s") or 0 for r in runs)
    out += [
      render_table(runs),
      "",
      *verdicts(runs),
      "",
      domain_gap(runs),
      "",
      f"Device time in these runs: training {train_s / 3600:.2f} h, evaluation "
      f"{eval_s / 3600:.2f} h (wall time of each process; arms sharing a device overlap).",
      "",
    ]
    for arm in sorted({r["arm"] for r in runs}):
      path = figure(runs, arm, fig_dir, f"lengen_text_{preset}_{arm}.png")
      out += [f"![{arm}, {preset}: position-wise PPL and the ratio over training]({path})", ""]
  return "\n".join(out)
