"""The mixers benchmark's report: results.json, results.md (the table) and results.png."""

from __future__ import annotations

import json
import os

from absl import logging

from experiments.benchmarks.mixers.timing import Timing


def _replace_file(path, text):
  """Writes `path` whole or not at all (a kill mid-write leaves the previous version)."""
  with open(path + ".tmp", "w") as fh:
    fh.write(text)
  os.replace(path + ".tmp", path)


def write(results, out, timing: Timing, plot=True):
  """results.json, results.md (the table) and, with `plot`, results.png under `out`. main calls it
  (without the plot) after every cell, so a run killed by its time limit keeps what it timed."""
  os.makedirs(out, exist_ok=True)
  _replace_file(os.path.join(out, "results.json"), json.dumps(results, indent=1))
  lens = sorted({int(r["T"]) for r in results["rows"]})
  lines = [
    "| row | mode | " + " | ".join(f"T={t}" for t in lens) + " |",
    "|---|---|" + "---|" * len(lens),
  ]
  keys = sorted({(r["row"], r["mode"]) for r in results["rows"]})
  for row, mode in keys:
    cells = []
    for t in lens:
      m = [r for r in results["rows"] if r["row"] == row and r["mode"] == mode and r["T"] == t]
      if not m:
        cells.append("")
      elif m[0].get("ms") is None:
        cells.append("err: " + m[0].get("error", "")[:40].replace("|", "/"))
      else:
        cells.append(f"{m[0]['ms']:.2f}")
    lines.append(f"| {row} | {mode} | " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  hdr = (
    f"Mixer timings in ms (median of {timing.reps}), batch {timing.shape.batch}, "
    f"{timing.shape.heads} heads x {timing.shape.dim}, bf16, device: {results.get('device')}\n\n"
  )
  if results.get("delta_rule_config"):
    hdr += f"Pallas delta-rule config: `{results['delta_rule_config']}`\n\n"
  if results.get("gain_config"):
    hdr += f"Pallas gain config: `{results['gain_config']}`\n\n"
  if results.get("check_failed"):
    hdr += f"**This config FAILED the GPU check:** {results['check_failed']}\n\n"
  if not lens:
    table = "(no rows timed)"
  _replace_file(os.path.join(out, "results.md"), hdr + table + "\n")
  if not plot:
    return table
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
      for row, m in keys:
        if m != mode:
          continue
        pts = sorted(
          (r["T"], r["ms"])
          for r in results["rows"]
          if r["row"] == row and r["mode"] == mode and r.get("ms") is not None
        )
        if pts:
          ax.plot(*zip(*pts), marker="o", label=row)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("T")
      ax.set_ylabel("ms")
      ax.set_title(mode)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=100)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("plot failed: %s", e)
  return table
