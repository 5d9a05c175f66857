"""RESULTS.md appendix: wall time of each evaluation suite, from the evaluations' summary.json files."""

from __future__ import annotations

import glob
import os

from experiments.studies.results.common import load, table

SUITES = ("ppl", "position_ppl", "state_stats", "effrem", "beta_eff", "retrieval")


def _rows(paths):
  rows = []
  for p in sorted(paths):
    s = load(p)
    run = os.path.relpath(
      os.path.dirname(os.path.dirname(p)),
      os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(p)))),
    )
    w = s["wall_time_s"]
    rows.append(
      [run, s["mixer"], s["settings"]["max_len"] or "-"]
      + [f"{w[k]:.1f}" if k in w else "-" for k in SUITES]
    )
  return rows


def render(results_dir: str, fig_dir: str) -> str:
  del fig_dir
  gpu = glob.glob(os.path.join(results_dir, "lengen", "*", "pretrain", "eval", "summary.json"))
  cpu = glob.glob(os.path.join(results_dir, "eval_example", "*", "eval", "summary.json"))
  if not gpu and not cpu:
    return ""
  header = ["run", "mixer", "max_len"] + [f"{k} s" for k in SUITES]
  out = [
    "## Appendix: evaluation wall time per suite",
    "",
    "From each evaluation's `eval/summary.json` (includes compilation; `state_stats` shares the "
    "`position_ppl` pass when both run, so it repeats that time).",
    "",
  ]
  if gpu:
    out += [
      "One H200, 30M LMs of section 3 (8 evaluations shared the GPU at once, so these are upper "
      "bounds); settings in section 3's command:",
      "",
      table(header, _rows(gpu)),
      "",
    ]
  if cpu:
    out += [
      "This 2-core CPU, the README quick start (`python -m experiments.evaluate "
      "--workdir=/tmp/kdn_mqar_smoke`, default settings; its plots are in docs/eval_example/):",
      "",
      table(header, _rows(cpu)),
      "",
    ]
  return "\n".join(out)
