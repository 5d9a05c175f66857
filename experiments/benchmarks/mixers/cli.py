"""Mixer-only timing: KDN (diag / iso), KDA and GDN in JAX, and fla's Triton kernels in PyTorch.

Usage:
  python -m experiments.benchmarks.mixers --out=/tmp/bench --seq_lens=2048,4096,8192
  python -m experiments.benchmarks.mixers --check_only   # GPU correctness check of the kernels

Batch 4, 16 heads of K = V = 128, bf16 inputs; median of --reps timed runs after --warmup runs,
forward and forward+backward. Writes results.md, results.json and results.png to --out (the
JSON and table after every sweep spec and cell, so a run cut off by its time limit keeps them).

The command line; what it runs is beside it: the rows and their inputs (arg_specs.py), the timing
(timing.py), the kernel-config sweeps (sweeps.py), the GPU exactness check (check.py) and the
report (report.py).
"""

from __future__ import annotations

import json
import time
import traceback

import jax
from absl import flags, logging

from experiments.benchmarks.mixers import arg_specs, check, report, sweeps, timing
from experiments.kernel_config import config_from_spec

# This script's flags live in their own registry: benchmarks/layers.py defines flags of the same names
# (--out, --seq_lens, ...) and a test process imports both modules.
FLAGS = flags.FlagValues()
flags.DEFINE_string("out", "/tmp/benchmark_mixers", "output directory", flag_values=FLAGS)
flags.DEFINE_list(
  "seq_lens", ["2048", "4096", "8192", "16384", "32768"], "sequence lengths", flag_values=FLAGS
)
flags.DEFINE_integer("batch", arg_specs.Shape.batch, "batch size", flag_values=FLAGS)
flags.DEFINE_integer("heads", arg_specs.Shape.heads, "heads", flag_values=FLAGS)
flags.DEFINE_integer("dim", arg_specs.Shape.dim, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer("reps", timing.Timing.reps, "timed runs (median reported)", flag_values=FLAGS)
flags.DEFINE_integer(
  "warmup", timing.Timing.warmup, "untimed runs after compilation", flag_values=FLAGS
)
flags.DEFINE_list(
  "rows",
  list(arg_specs.ROWS),
  "rows to time; diag_kdn_seg_<impl> / iso_kdn_seg_<impl>: with segment_ids "
  "(packed documents of 1000 tokens)",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "chunked_max_len", 32768, "skip *_chunked rows above this length", flag_values=FLAGS
)
flags.DEFINE_list(
  "pallas_lens",
  [],
  "if set, time *_pallas rows only at these lengths (each new length compiles the kernels again)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean("check", True, "run the GPU correctness check first", flag_values=FLAGS)
flags.DEFINE_boolean("check_only", False, "only run the correctness check", flag_values=FLAGS)
flags.DEFINE_integer(
  "check_dim",
  128,
  "head width K = V of the correctness check: a width the "
  "kernels take as it is (16, 32, 64, 128, 256; the ops pad others onto them)",
  flag_values=FLAGS,
)
flags.DEFINE_float(
  "time_budget_s",
  420.0,
  "stop timing new cells (and sweep specs) after this many seconds",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "sweep",
  [],
  "DeltaRuleConfig overrides to try on diag_kdn_pallas fwd+bwd at "
  "--sweep_len, each 'field=value/field=value' ('default': none), e.g. "
  "'num_warps_intra=2/block_v=32'; the fastest is used for the rows",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "gain_sweep",
  [],
  "GainConfig overrides to try on --gain_sweep_row, same "
  "syntax, e.g. 'max_chunk=128/num_stages_fwd=2'",
  flag_values=FLAGS,
)
flags.DEFINE_enum(
  "gain_sweep_row",
  "diag_gain_pallas",
  list(arg_specs.GAIN_SWEEP_ROWS),
  "the row --gain_sweep times: a gain alone, or a KDN op (the gain inside it)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "gain_sweep_fwd_bwd",
  True,
  "rank the --gain_sweep specs by fwd+bwd (else by the forward alone)",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "sweep_len", sweeps.Sweep.length, "sequence length for the sweeps", flag_values=FLAGS
)
flags.DEFINE_enum(
  "sweep_row",
  "diag_kdn_pallas",
  list(arg_specs.SWEEP_ROWS),
  "the row --sweep times (fwd+bwd); the *_seg rows sweep the packed-documents path",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_stages",
  False,
  "time the pallas stages (see --stages) under every delta-rule sweep spec",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_fwd_only",
  False,
  "rank the --sweep specs by the forward alone (inference, or a forward-only kernel option)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_repeat_first",
  True,
  "time a sweep's first spec (its baseline) again "
  "after the others and rank it by that timing: a process's first timed spec can "
  "read slow (docs/decisions.md, --sweep_repeat_first)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_combine",
  True,
  "after a sweep, also time the first spec merged with every spec that beat it",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "stages_docs",
  False,
  "with --stages, also time the stages at the first length with packed documents (segment_ids)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "stages",
  False,
  "also time the pallas stages one by one (diag KDN): the gain, then the delta rule's "
  "stages as the op runs them (pallas_kernels.delta_rule.forward_stages / "
  "backward_stages), each jitted alone",
  flag_values=FLAGS,
)


def _timing():
  shape = arg_specs.Shape(FLAGS.batch, FLAGS.heads, FLAGS.dim)
  return timing.Timing(shape, FLAGS.reps, FLAGS.warmup)


def _sweep_settings():
  return sweeps.Sweep(_timing(), FLAGS.sweep_len, FLAGS.sweep_repeat_first, FLAGS.sweep_combine)


def _sweeps(results, deadline, save):
  """The KernelConfigs the rows run with: the tuned configs, each family's sweep winner."""
  from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

  base, gbase = tuned.tuned("delta_rule"), tuned.tuned("gain")
  how = _sweep_settings()
  kernels = sweeps.sweep(
    results,
    FLAGS.sweep,
    tuned.KernelConfigs(delta_rule=base, gain=gbase),
    "delta_rule",
    lambda spec: config_from_spec(base, spec),
    FLAGS.sweep_row,
    not FLAGS.sweep_fwd_only,
    "delta_rule_config",
    deadline,
    how,
    stages=FLAGS.sweep_stages,
    save=save,
  )
  kernels = sweeps.sweep(
    results,
    FLAGS.gain_sweep,
    kernels,
    "gain",
    lambda spec: config_from_spec(gbase, spec),
    FLAGS.gain_sweep_row,
    FLAGS.gain_sweep_fwd_bwd,
    "gain_config",
    deadline,
    how,
    save=save,
  )
  print("configs:", results.get("delta_rule_config"), results.get("gain_config"), flush=True)
  return kernels


def main(argv):
  del argv
  results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": []}
  start = time.time()
  save = lambda: report.write(
    results, FLAGS.out, _timing(), plot=False
  )  # after every step: a killed run keeps it
  # Sweeps first, so that the check covers the configuration the rows use.
  kernels = _sweeps(results, start + FLAGS.time_budget_s, save)
  results.setdefault("delta_rule_config", repr(kernels.delta_rule))
  results.setdefault("gain_config", repr(kernels.gain))  # (both: the rows run with them)
  save()
  if FLAGS.check or FLAGS.check_only:
    try:
      results["check"] = check.run_check(d=FLAGS.check_dim, kernels=kernels)
      bad = check.check_violations(results["check"])
      if bad:  # the rows still run (they time this config), but the report says it is wrong
        results["check_failed"] = bad
        logging.error("GPU CHECK FAILED for %s: %s", results.get("delta_rule_config"), bad)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      results["check_error"] = repr(e)[:2000]
    if FLAGS.check_only:
      report.write(results, FLAGS.out, _timing())
      return
    save()
  have_fla = arg_specs.fla() is not None
  if FLAGS.stages:
    for t, docs in [(int(z), False) for z in FLAGS.seq_lens[:2]] + (
      [(int(FLAGS.seq_lens[0]), True)] if FLAGS.stages_docs else []
    ):
      try:
        rec = {"stages": timing.time_stages(t, _timing(), docs, kernels), "T": t, "docs": docs}
      except Exception as e:  # pylint: disable=broad-except
        rec = {"stages_error": f"{type(e).__name__}: {e}"[:500], "T": t, "docs": docs}
      print(json.dumps(rec), flush=True)
      results.setdefault("stage_times", []).append(rec)
      save()
  for t in (int(s) for s in FLAGS.seq_lens):
    for row in FLAGS.rows:
      if row.startswith("fla") and not have_fla:
        continue
      if row.endswith("chunked") and t > FLAGS.chunked_max_len:
        continue
      if row.endswith("pallas") and FLAGS.pallas_lens and str(t) not in FLAGS.pallas_lens:
        continue
      for mode in ("fwd", "fwd+bwd"):
        if time.time() - start > FLAGS.time_budget_s:
          continue
        rec = {"row": row, "mode": mode, "T": t}
        try:
          fb = mode == "fwd+bwd"
          rec["ms"] = (
            timing.time_fla_row(row, t, fb, _timing())
            if row.startswith("fla")
            else timing.time_jax_row(row, t, fb, _timing(), kernels=kernels)
          )
        except Exception as e:  # pylint: disable=broad-except
          rec["ms"] = None
          rec["error"] = f"{type(e).__name__}: {e}"[:300]
          logging.warning("%s %s T=%d failed: %s", row, mode, t, traceback.format_exc()[-1500:])
        print(json.dumps(rec), flush=True)
        results["rows"].append(rec)
        save()
  print(report.write(results, FLAGS.out, _timing()))
