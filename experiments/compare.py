"""Compares runs' evaluations: each suite's curves overlaid with their 95% bands in one PNG, and a
table of each run's difference from the first run with a 95% bootstrap interval.

    python -m experiments.compare /tmp/lm /tmp/lm_sp --suite=position_ppl,effrem --out=/tmp/cmp

A RUN is an evaluation folder (it holds ``<suite>.json``) or a run workdir: its ``eval/`` folder, else
its newest ``eval/step<k>/``. The differences are over the evaluation's units (windows, documents,
sequences), which the suites record per unit: paired (the same draw of units for both runs) when the
two evaluations scored the same examples (equal ``examples_hash`` in their JSON), else unpaired (each
run's units drawn on their own), which the table says.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap

import numpy as np
from absl import app, flags

from experiments.evaluation import bootstrap, plots
from experiments.runner import cli, plot_style
from experiments.runner.logging_utils import write_json
from experiments.studies.results.common import load, table


@dataclasses.dataclass(frozen=True)
class Curve:
  """How one suite's JSON reads as a curve over ``x`` with per-unit values ``units`` [N, len(x)]."""

  x: str  # the key of the positions
  units: str  # the key of the per-unit values
  quantity: str  # what a difference is of (its unit)
  ylabel: str
  shown: str  # the baseline column's name
  exp: bool = False  # shown as exp(value) (a mean NLL as a perplexity)
  stored: tuple[str, str, str] | None = None  # (estimate, lo, hi) keys, for JSON without units


SUITES = {
  "position_ppl": Curve(
    "bucket_center",
    "bucket_nll_per_sequence",
    "mean NLL per position bucket (nats; exp = PPL ratio)",
    "perplexity at t",
    "PPL",
    exp=True,
    stored=("bucket_ppl", "bucket_ppl_lo", "bucket_ppl_hi"),
  ),
  "topic_floor": Curve(
    "bucket_center",
    "bucket_excess_per_document",
    "excess NLL over the floor per position bucket (nats)",
    "excess NLL over the Bayes floor (nats)",
    "excess",
    stored=("excess.estimate", "excess.lo", "excess.hi"),
  ),
  "effrem": Curve("t", "per_sequence", "EffRem at prefix cut t", "EffRem_T(t)", "EffRem"),
}
DEFAULT_OUT = "/tmp/kdn_compare"

FLAGS = flags.FlagValues()
flags.DEFINE_list(
  "suite", ["position_ppl"], f"suites compared, of {list(SUITES)}", flag_values=FLAGS
)
flags.DEFINE_string("out", DEFAULT_OUT, "folder of the PNGs and compare.json", flag_values=FLAGS)
flags.DEFINE_integer("resamples", bootstrap.RESAMPLES, "bootstrap resamples", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "seed of the bootstrap", flag_values=FLAGS)


def _get(d: dict, key: str):
  for part in key.split("."):
    d = d[part]
  return d


# ------------------------------------------------------------------------------------------ loading
def find_eval(run: str, suite: str) -> str:
  """The ``<suite>.json`` of ``run`` (see the module docstring); a ValueError in one line."""
  if not os.path.isdir(run):
    raise ValueError(f"RUN: {run!r} is not a folder (a run workdir or an evaluation folder)")
  for folder in (run, os.path.join(run, "eval")):
    if os.path.exists(os.path.join(folder, f"{suite}.json")):
      return os.path.join(folder, f"{suite}.json")
  root = os.path.join(run, "eval")
  steps = sorted(
    (int(m.group(1)), d)
    for d in (os.listdir(root) if os.path.isdir(root) else [])
    if (m := re.fullmatch(r"step(\d+)", d))
    and os.path.exists(os.path.join(root, d, f"{suite}.json"))
  )
  if not steps:
    raise ValueError(
      f"RUN: no {suite}.json in {run}, {root} or {root}/step<k>; evaluate it first "
      f"(python -m experiments.evaluate --workdir={run} --suite={suite})"
    )
  return os.path.join(root, steps[-1][1], f"{suite}.json")


@dataclasses.dataclass
class Evaluation:
  label: str
  path: str
  res: dict

  def units(self, curve: Curve) -> np.ndarray | None:
    u = self.res.get(curve.units)
    return None if u is None else np.asarray(u, np.float64)

  @property
  def examples(self) -> str | None:
    return self.res.get("examples_hash")


def labels(paths: list[str]) -> list[str]:
  """The shortest path tails (with the evaluated step) that tell the runs apart."""
  metas = [load(p).get("meta", {}) for p in paths]
  runs = [os.path.normpath(m.get("workdir") or os.path.dirname(p)) for m, p in zip(metas, paths)]
  for depth in range(1, 8):
    names = [
      "/".join(r.split(os.sep)[-depth:]) + (f"@{m['step']}" if m.get("step") is not None else "")
      for r, m in zip(runs, metas)
    ]
    if len(set(names)) == len(names):
      return names
  return [f"{i}:{n}" for i, n in enumerate(names)]


def load_runs(runs: list[str], suite: str) -> list[Evaluation]:
  paths = [find_eval(r, suite) for r in runs]
  return [Evaluation(lab, p, load(p)) for lab, p in zip(labels(paths), paths)]


# ------------------------------------------------------------------------------------------ numbers
def band(ev: Evaluation, curve: Curve, resamples: int, seed: int):
  """(x, estimate, lo, hi) of one run's curve as shown (lo, hi None without a band)."""
  x = np.asarray(ev.res[curve.x], np.float64)
  u = ev.units(curve)
  if u is not None:
    iv = bootstrap.mean(u, resamples=resamples, seed=seed)
    est, lo, hi = (np.asarray(v) for v in (iv.estimate, iv.lo, iv.hi))
    return (x, *(np.exp(v) for v in (est, lo, hi))) if curve.exp else (x, est, lo, hi)
  if curve.stored is None:
    return x, np.asarray(ev.res.get("mean"), np.float64), None, None
  return (x, *(np.asarray(_get(ev.res, k), np.float64) for k in curve.stored))


def difference(
  ev: Evaluation, base: Evaluation, curve: Curve, resamples: int, seed: int
) -> tuple[bootstrap.Interval | None, str]:
  """``ev`` minus ``base`` per position with its interval, and how it was drawn (or why not)."""
  a, b = ev.units(curve), base.units(curve)
  if a is None or b is None:
    missing = ev.label if a is None else base.label
    return None, f"n/a: {missing}'s JSON has no per-unit values ({curve.units}); re-evaluate it"
  if not np.array_equal(ev.res[curve.x], base.res[curve.x]):
    return None, f"n/a: other positions ({curve.x} differ)"
  kw = {"resamples": resamples, "seed": seed}
  if ev.examples is not None and ev.examples == base.examples and a.shape == b.shape:
    return bootstrap.paired_difference(a, b, **kw), f"paired over {len(a)} shared examples"
  why = (
    "no examples_hash in a JSON"
    if ev.examples is None or base.examples is None
    else f"other examples ({len(a)} vs {len(b)} units)"
  )
  return bootstrap.unpaired_difference(a, b, **kw), f"unpaired: {why}"


def data_line(ev: Evaluation, suite: str) -> str:
  """What an evaluation scored, in words (the PNG's second title line)."""
  s = ev.res.get("meta", {}).get("settings", {})
  if suite == "topic_floor":
    src = ev.res.get("source", {})
    return (
      f"{ev.res.get('documents')} topic-source documents of {ev.res.get('length')} "
      f"(vocabulary {src.get('vocab_size')}, seed {ev.res.get('seed')})"
    )
  n = ev.res.get("sequences")
  length = ev.res.get("max_len") or ev.res.get("T")
  data = os.path.basename(s.get("long_eval_path") or "") or "the run's long_eval_path"
  return f"{n} windows of {length} tokens from {data} (seed {s.get('seed')})"


# ------------------------------------------------------------------------------------------ output
def plot(evs: list[Evaluation], suite: str, curve: Curve, path: str, resamples: int, seed: int):
  plt = plot_style.plt()

  fig, ax = plt.subplots(figsize=(10, 4.8))
  colors = plt.get_cmap("tab10" if len(evs) <= 10 else "viridis")
  for i, ev in enumerate(evs):
    color = colors(i if len(evs) <= 10 else i / max(len(evs) - 1, 1))
    x, est, lo, hi = band(ev, curve, resamples, seed)
    ax.plot(x, est, "-", lw=1.5, color=color, label=ev.label)
    if lo is not None:
      ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
  train_len = evs[0].res.get("train_len")
  if train_len and curve.x == "bucket_center":
    ax.axvline(train_len, color="k", ls="--", lw=1, label=f"training length {train_len}")
  ax.set_xscale("log")
  if curve.exp:
    ax.set_yscale("log")
  plot_style.plain_log_ticks(ax, "x", minor=False)  # 20, not 2x10^1
  if curve.exp:
    plot_style.plain_log_ticks(ax)
  ax.set_xlabel("position t (tokens)" if curve.x == "bucket_center" else "prefix cut t")
  ax.set_ylabel(curve.ylabel)
  datas = "; ".join(sorted({data_line(ev, suite) for ev in evs}))
  ax.set_title(
    textwrap.fill(f"{suite}: {' vs '.join(ev.label for ev in evs)}", 100)
    + "\n"
    + textwrap.fill(datas, 110),
    fontsize=9,
  )
  ax.grid(alpha=0.3, which="both")
  plot_style.legend_outside(ax, fontsize=8, title="bands: 95% bootstrap", title_fontsize=8)
  return plots._save(fig, path)  # pylint: disable=protected-access


def compare_suite(evs, suite, resamples=bootstrap.RESAMPLES, seed=0) -> tuple[str, dict]:
  """The markdown table of differences from the first run, and the same as JSON."""
  curve = SUITES[suite]
  base = evs[0]
  x = base.res[curve.x]
  _, est, _, _ = band(base, curve, resamples, seed)
  diffs = [(ev, *difference(ev, base, curve, resamples, seed)) for ev in evs[1:]]
  header = [curve.x, f"{base.label} {curve.shown}"] + [
    f"{ev.label} − {base.label}" for ev, *_ in diffs
  ]
  rows = []
  for j, xj in enumerate(x):
    row = [f"{xj:g}", float(est[j])]
    for _, iv, _ in diffs:
      row.append(
        "n/a"
        if iv is None
        else f"{iv.estimate[j]:+.3f} [{iv.lo[j]:+.3f}, {iv.hi[j]:+.3f}]"
        + ("" if iv.lo[j] <= 0 <= iv.hi[j] else " *")
      )
    rows.append(row)
  notes = [f"- {ev.label} − {base.label}: {how}" for ev, _, how in diffs]
  text = "\n".join(
    [
      f"{suite}: difference of the {curve.quantity} from {base.label}, 95% bootstrap intervals "
      "(* : the interval excludes 0)",
      table(header, rows),
      *notes,
    ]
  )
  out = {
    "suite": suite,
    "x": list(x),
    "baseline": base.label,
    "runs": {ev.label: ev.path for ev in evs},
    "differences": {
      ev.label: {"how": how, **({} if iv is None else iv.to_json())} for ev, iv, how in diffs
    },
  }
  return text, out


def check_args(runs, suites, resamples):
  if len(runs) < 2:
    raise ValueError(f"RUN: give at least two runs to compare, got {len(runs)}")
  bad = [s for s in suites if s not in SUITES]
  if bad or not suites:
    raise ValueError(f"--suite: expected names from {list(SUITES)}, got {list(suites)}")
  if resamples < 100:
    raise ValueError(f"--resamples: use at least 100 bootstrap resamples, got {resamples}")


def main(argv):
  runs = argv[1:]
  try:
    check_args(runs, FLAGS.suite, FLAGS.resamples)
    loaded = {s: load_runs(runs, s) for s in FLAGS.suite}
  except ValueError as e:
    print(f"compare error: {e}", file=sys.stderr)
    return 2
  os.makedirs(FLAGS.out, exist_ok=True)
  report = {}
  for suite, evs in loaded.items():
    text, report[suite] = compare_suite(evs, suite, FLAGS.resamples, FLAGS.seed)
    png = plot(
      evs,
      suite,
      SUITES[suite],
      os.path.join(FLAGS.out, f"{suite}.png"),
      FLAGS.resamples,
      FLAGS.seed,
    )
    print(text + f"\n(plot: {png})\n", flush=True)
  print(f"compare: wrote {write_json(os.path.join(FLAGS.out, 'compare.json'), report)}")
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
