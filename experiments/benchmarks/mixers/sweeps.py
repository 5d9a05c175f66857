"""Kernel-config sweeps of the mixers benchmark: one row timed under each spec of one kernel family
(``field=value/...``, experiments/kernel_config.py), the fastest kept for the rows after."""

from __future__ import annotations

import dataclasses
import json
import time

from absl import logging

from experiments.benchmarks.mixers import arg_specs
from experiments.benchmarks.mixers import timing as timing_lib


@dataclasses.dataclass(frozen=True)
class Sweep:
  """How a sweep times its specs: at ``length`` with ``timing``; ``repeat_first``: the first spec
  (the baseline) timed again after the others and ranked by that timing (a process's first timed
  spec can read slow: docs/decisions.md, --sweep_repeat_first); ``combine``: the first spec merged
  with every spec that beat it, timed too."""

  timing: timing_lib.Timing = timing_lib.Timing()
  length: int = 4096
  repeat_first: bool = True
  combine: bool = True


def sweep(
  results,
  specs,
  kernels,
  family,
  make_config,
  row,
  fwd_bwd,
  key,
  deadline,
  how: Sweep,
  stages=False,
  save=lambda: None,
):
  """Times `row` at how.length under `kernels` (a pallas_kernels.KernelConfigs) with its
  `family` member replaced by make_config(spec) for each spec (with the pallas stage split when
  `stages`) until time.time() passes `deadline`; with how.repeat_first the first spec is
  timed again after the others (a record with "repeat": true, no stage split) and ranks by that
  timing; with how.combine, the specs that beat the first one are merged into one more spec
  and timed too. Returns `kernels` with the fastest config (recorded under results[key]), or
  unchanged if none ran."""
  timed = []  # (spec, ms or None, config)

  def run(spec, repeat=False):
    if time.time() > deadline:
      logging.warning("time budget spent: sweep %s not timed", spec)
      results.setdefault("sweeps", []).append({"sweep": spec, "skipped": "time budget"})
      save()
      return
    cfg = make_config(spec)
    trial = dataclasses.replace(kernels, **{family: cfg})
    first = {}
    try:
      ms = timing_lib.time_jax_row(row, how.length, fwd_bwd, how.timing, first, trial)
    except Exception as e:  # pylint: disable=broad-except
      ms = None
      logging.warning("sweep %s failed: %s", spec, e)
    rec = {
      "sweep": spec,
      "row": row,
      "fwd_bwd": fwd_bwd,
      "T": how.length,
      "ms": ms,
      "first_call_s": first.get(row),
    }
    if repeat:
      rec["repeat"] = True
    if stages and ms is not None and not repeat:
      try:
        split = timing_lib.time_stages(how.length, how.timing, arg_specs.is_docs_row(row), trial)
        rec["stages"] = {k: v if isinstance(v, dict) else round(v, 3) for k, v in split.items()}
      except Exception as e:  # pylint: disable=broad-except
        rec["stages_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(rec), flush=True)
    results.setdefault("sweeps", []).append(rec)
    if repeat:  # (a failed repeat keeps the first timing)
      timed[0] = (spec, ms if ms is not None else timed[0][1], cfg)
    else:
      timed.append((spec, ms, cfg))
    save()

  for spec in specs:
    run(spec)
  if how.repeat_first and len(specs) > 1 and len(timed) == len(specs) and timed[0][1] is not None:
    run(specs[0], repeat=True)
  if how.combine and timed and len(timed) == len(specs):
    combined = combine_winners([(spec, ms) for spec, ms, _ in timed])
    if combined is not None and combined not in specs:
      run(combined)
  ok = [(ms, cfg) for _, ms, cfg in timed if ms is not None]
  if not ok:
    return kernels
  best = min(ok, key=lambda m: m[0])[1]
  results[key] = repr(best)
  return dataclasses.replace(kernels, **{family: best})


def combine_winners(timed):
  """The first spec plus the overrides of every later spec that beat it (None if < 2 did); when
  winners set the same field, the faster spec's value is kept."""
  (base, base_ms), rest = timed[0], timed[1:]
  if base_ms is None:
    return None
  wins = sorted(((ms, spec) for spec, ms in rest if ms is not None and ms < base_ms), reverse=True)
  if len(wins) < 2:
    return None
  fields = {}
  for spec in [base] + [spec for _, spec in wins]:  # slowest winner first, fastest last
    if spec not in ("", "default"):
      fields.update(item.partition("=")[::2] for item in spec.split("/"))
  return "/".join(f"{k}={v}" for k, v in fields.items())
