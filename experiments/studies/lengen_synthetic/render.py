"""RESULTS.md: length generalisation on the synthetic topic source, from
docs/results/lengen_synthetic/
<preset>/*.json (one JSON per evaluated run, written by experiments/studies/lengen_synthetic/study.py)."""

from __future__ import annotations

import glob
import math
import os

import numpy as np

from experiments.evaluation import bootstrap, topic_floor
from experiments.studies.results import common

STAGES = ("pretrain", "zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
PRESET_TITLE = {
  "tiny": "tiny preset (CPU: 2 layers, d=64)",
  "default": "default preset (GPU: 4 layers, d=256; Zipf exponent 1.1: a topic is identified "
  "from a few tokens)",
  "zipf015": "default preset with data.topic.zipf_exponent=0.15 (GPU; topics nearly uniform: "
  "identifying one takes ~100 tokens, so the floor keeps falling far past T)",
  "counts_tiny": "tiny preset on the Dirichlet source (CPU: 2 layers, d=64; each document its own "
  "unigram law over 64 tokens, so the optimum counts without bound)",
}
SEED = 0  # bootstrap seed of the paired comparisons
FIX_RATIO = 1.15  # an intervention fixes a failing model: its PPL late / early at most this ...
FIX_IN_RANGE = 1.03  # ... with its in-range perplexity within 3% of the zero control's


def load_runs(preset_dir: str) -> list[dict]:
  """The study's per-run JSON of one preset folder, ordered by mixer, stage and step."""
  runs = [
    common.load(p)
    for p in glob.glob(os.path.join(preset_dir, "*.json"))
    if os.path.basename(p) != "commands.json"
  ]
  runs = [r for r in runs if r.get("study") == "lengen_synthetic"]
  for r in runs:
    r["topic_floor"] = topic_floor.with_verdict(r["topic_floor"])
  return sorted(
    runs,
    key=lambda r: (r["mixer"], STAGES.index(r["stage"]) if r["stage"] in STAGES else 99, r["step"]),
  )


def _label(r: dict) -> str:
  if r["stage"] == "pretrain":
    return f"pretrained (zero), step {r['step']}"
  return f"+{r['step']} {r['stage']}"


def _control(runs, mixer):
  """The zero-state post-training control of a mixer, if evaluated."""
  return next((r for r in runs if r["mixer"] == mixer and r["stage"] == "zero"), None)


def _versus_control(r, control) -> str:
  """Paired difference of the late-window excess against the zero control (the same documents)."""
  if control is None or r["stage"] in ("pretrain", "zero"):
    return ""
  a, b = r["topic_floor"]["per_document"]["late"], control["topic_floor"]["per_document"]["late"]
  if len(a) != len(b) or r["topic_floor"].get("seed") != control["topic_floor"].get("seed"):
    return "n/a (other documents)"
  return common.interval(bootstrap.paired_difference(a, b, seed=SEED).to_json())


def render_table(runs: list[dict]) -> str:
  """The markdown table: one row per evaluated run."""
  if not runs:
    return "No evaluated runs yet."
  tf0 = runs[0]["topic_floor"]
  (ea, eb), (la, lb) = tf0["early_window"], tf0["late_window"]
  level = round(100 * tf0["excess"]["level"])
  header = [
    "mixer",
    "run",
    "tokens",
    f"NLL [{ea}, {eb})",
    f"NLL [{la}, {lb})",
    "PPL late / early",
    "verdict",
    f"excess [{ea}, {eb})",
    f"excess [{la}, {lb})",
    "excess growth",
    "late excess - zero control (paired)",
  ]
  rows = []
  for r in runs:
    tf = r["topic_floor"]
    rows.append(
      [
        r["mixer"],
        _label(r),
        common.short_count(r["tokens"]),
        common.interval(tf["nll_early"]),
        common.interval(tf["nll_late"]),
        common.interval(tf["ppl_ratio"], 2),
        tf["verdict"],
        common.interval(tf["early"]),
        common.interval(tf["late"]),
        common.interval(tf["excess_growth"]),
        _versus_control(r, _control(runs, r["mixer"])),
      ]
    )
  return (
    f"The model's NLL and its excess over the exact Bayes floor (nats per token), means over "
    f"{tf0['documents']} evaluation documents with {level}% percentile-bootstrap intervals "
    f'(documents resampled; "PPL late / early" and "excess growth" pair each document\'s two '
    f'windows, "late excess - zero control" pairs the documents of two runs).\n\n'
    + common.table(header, rows)
  )


def readings(runs: list[dict]) -> list[str]:
  """One line per mixer: is the failure shown from the zero start, and which post-training removes
  it (the control still fails, the intervention's ratio is <= FIX_RATIO and its in-range NLL within
  FIX_IN_RANGE of the control's)."""
  lines = []
  for mixer in sorted({r["mixer"] for r in runs}):
    mine = [r for r in runs if r["mixer"] == mixer]
    pre = [r for r in mine if r["stage"] == "pretrain"]
    if not pre:
      continue
    last = pre[-1]["topic_floor"]
    text = (
      f"- **{mixer}**: zero-start pretraining (step {pre[-1]['step']}): {last['verdict']} "
      f"(PPL late / early {common.interval(last['ppl_ratio'], 2)})"
    )
    post = {r["stage"]: r["topic_floor"] for r in mine if r["stage"] != "pretrain"}
    if post:
      text += "; after post-training: " + ", ".join(
        f"{s} {tf['verdict']} ({tf['ppl_ratio']['estimate']:.2f})" for s, tf in post.items()
      )
      ctrl = post.get("zero")
      if ctrl is not None and ctrl["verdict"] == "failure":
        fixed = [
          s
          for s, tf in post.items()
          if s != "zero"
          and tf["ppl_ratio"]["estimate"] <= FIX_RATIO
          and tf["nll_early"]["estimate"] - ctrl["nll_early"]["estimate"] <= math.log(FIX_IN_RANGE)
        ]
        text += f". Fix shown: {', '.join(fixed) or 'none'}"
    lines.append(text + ".")
  return lines


def figure(runs: list[dict], mixer: str, fig_dir: str, name: str) -> str:
  """Excess NLL by position, the last pretraining checkpoint and every post-training, with bands."""
  p = common.plt()
  fig, ax = p.subplots(figsize=(8, 4.6))
  mine = [r for r in runs if r["mixer"] == mixer]
  pre = [r for r in mine if r["stage"] == "pretrain"]
  shown = pre[-1:] + [r for r in mine if r["stage"] != "pretrain"]
  for r in shown:
    tf = r["topic_floor"]
    x, ex = np.asarray(tf["bucket_center"]), tf["excess"]
    (line,) = ax.plot(x, ex["estimate"], lw=1.3, label=_label(r))
    ax.fill_between(x, ex["lo"], ex["hi"], color=line.get_color(), alpha=0.15)
  tf = shown[0]["topic_floor"]
  ax.axvline(
    tf["train_len"], color="k", ls="--", lw=1, label=f"training length T = {tf['train_len']}"
  )
  ax.axvspan(tf["late_window"][0], tf["late_window"][1], color="tab:orange", alpha=0.08)
  ax.axhline(0, color="k", lw=0.6)
  ax.set(
    xscale="log", xlabel="position t (tokens)", ylabel="excess NLL over the Bayes floor (nats)"
  )
  ax.set_title(f"{mixer}: {tf['claim']}", fontsize=7.5, wrap=True)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  return common.save(fig, fig_dir, name)


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, "lengen_synthetic")
  if not common.exists(root):
    return ""
  intro = (
    "Synthetic sources with an exact floor (experiments/data/topic_source.py). The `hmm` family: "
    "each document starts in a uniformly drawn topic, switches to another topic with a fixed "
    "probability per token, and draws tokens from its topic's Zipf law over its own permutation "
    "of the vocabulary; the HMM forward algorithm is its floor. The `dirichlet` family: each "
    "document draws its own unigram law from a Dirichlet prior; the Dirichlet-multinomial "
    "predictive (n + a) / (t + V a) is its floor, which keeps falling at every length, so the "
    "optimum needs a state that counts past any training length. Each model is read with its "
    "state carried over long documents. Verdict (the paper's own measure and the text study's "
    f"rule): {topic_floor.RULE}, with PPL the model's own perplexity at [T/2, T) (early) and "
    f"[4096, 8192) (late). A fix is shown when the zero control fails and an intervention brings "
    f"the ratio to <= {FIX_RATIO:g} with in-range perplexity within {100 * (FIX_IN_RANGE - 1):.0f}% "
    "of the control's. The excess over the floor says how much of what the source offers past T "
    "a model leaves unused."
  )
  out = ["## 3b. Length generalisation on a synthetic source with an exact floor", "", intro, ""]
  for preset, pdir, runs in common.preset_runs(root, load_runs):
    out += [f"### {PRESET_TITLE.get(preset, preset)}", "", *common.commands_lines(pdir)]
    out += [render_table(runs), "", *readings(runs), ""]
    for mixer in sorted({r["mixer"] for r in runs}):
      path = figure(runs, mixer, fig_dir, f"lengen_synthetic_{preset}_{mixer}.png")
      out += [f"![{mixer}, {preset}: excess NLL by position]({path})", ""]
  return "\n".join(out)
