r"""The delta-rule output stage (O = Qbar S_0 + P Delta) alone: Triton against Mosaic GPU (issue 18).

Rows, each at B=4 H=16 K=V=128 bf16 and T in --seq_lens (default 4096, 16384):
  triton c16    output.output_forward, the default config (chunk 16)
  triton c64    output.output_forward, the default config at chunk 64 (issue 18's layout)
  mosaic c64    output_mgpu.output_forward on the same chunk-64 inputs as `triton c64`
Inputs are what the forward hands the stage under bf16-operand dots: q bf16, g fp32, P / Delta /
chunk-start states bf16. Each row reports the median wall time of --reps jitted calls and the
device time of its kernels from a jax.profiler trace (experiments/profile_layer.parse_trace);
`mosaic c64` also the max error against `triton c64` relative to max |O|. A row that fails
(compile error, ...) records the error and the others still run.

GPU (device tool, H200):
  python -m experiments.benchmark_output_stage --out=$OUT/output_stage.json
CPU check of the script (every row in interpret mode, tiny shapes):
  python -m experiments.benchmark_output_stage --interpret --batch=1 --heads=1 --dim=64 \
      --seq_lens=128 --reps=1 --out=/tmp/output_stage.json
Without --interpret and without a Hopper GPU (or with a jax lacking Mosaic GPU) it exits with
the reason before timing anything.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import cli, timing
from experiments.logging_utils import write_json
from pallas_kernels.delta_rule import config, output, output_mgpu

FLAGS = flags.FlagValues()
flags.DEFINE_list("seq_lens", ["4096", "16384"], "sequence lengths T", flag_values=FLAGS)
flags.DEFINE_integer("batch", 4, "B", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "H", flag_values=FLAGS)
flags.DEFINE_integer("dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_list("rows", ["triton_c16", "triton_c64", "mosaic_c64"], "rows to run",
                  flag_values=FLAGS)
flags.DEFINE_integer("reps", 20, "timed calls (median reported)", flag_values=FLAGS)
flags.DEFINE_integer("iters", 5, "calls inside the profiler trace (0: no trace)", flag_values=FLAGS)
flags.DEFINE_boolean("interpret", False, "every row in interpret mode (a CPU check of the script)",
                     flag_values=FLAGS)
flags.DEFINE_string("out", "/tmp/output_stage.json", "JSON output path", flag_values=FLAGS)

SCALE = 128 ** -0.5
_CFG64 = dataclasses.replace(config.DEFAULT, max_chunk=64, min_chunk=64)
# row -> (chunk, config, stage module)
ROWS = {"triton_c16": (16, config.DEFAULT, output),
        "triton_c64": (64, _CFG64, output),
        "mosaic_c64": (64, _CFG64, output_mgpu)}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def make_inputs(b, t, h, d, chunk, seed):
  """(q, g, P, Delta, states, h0) as the forward hands them to the stage (bf16 operands)."""
  ks = jax.random.split(jax.random.key(seed), 5)
  bf16 = jnp.bfloat16
  q = (jax.random.normal(ks[0], (b, t, h, d)) / d ** 0.5).astype(bf16)
  la = -0.1 * jax.random.uniform(ks[1], (b, t // chunk, chunk, h, d))
  g = jnp.cumsum(la, axis=2).reshape(b, t, h, d)
  causal = jnp.tril(jnp.ones((chunk, chunk)))
  p = (jax.random.normal(ks[2], (b, h, t // chunk, chunk, chunk)) * causal / chunk)
  p = p.reshape(b, h, t, chunk).astype(bf16)
  delta = jax.random.normal(ks[3], (b, t, h, d)).astype(bf16)
  states = jax.random.normal(ks[4], (b, h, t // chunk, d, d)).astype(bf16)
  return q, g, p, delta, states, jnp.zeros((b, h, d, d), jnp.float32)


def stage_fn(row, interpret):
  chunk, cfg, mod = ROWS[row]
  return jax.jit(functools.partial(mod.output_forward, cont=None, chunk=chunk, scale=SCALE,
                                   interpret=interpret, cfg=cfg, cfg_prec="fast"))


def device_ms(fn, args, iters):
  """Device time per call of fn's kernels from a profiler trace (CPU: host XLA op time)."""
  from experiments import profile_layer  # pylint: disable=g-import-not-at-top
  logdir = tempfile.mkdtemp(prefix="output_stage_")
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(iters):
      jax.block_until_ready(fn(*args))
  prof = profile_layer.parse_trace(profile_layer.find_trace(logdir), iters)
  return prof["total_device_ms"], [(k["name"], round(k["ms"], 4)) for k in prof["kernels"][:4]]


def max_rel_err(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def run_row(row, t, interpret, reference):
  """One row: timings, and for mosaic_c64 the error against triton_c64's output."""
  res = {"row": row, "T": t, "chunk": ROWS[row][0]}
  try:
    args = make_inputs(FLAGS.batch, t, FLAGS.heads, FLAGS.dim, ROWS[row][0], 0)
    fn = stage_fn(row, interpret)
    o = jax.block_until_ready(fn(*args))
    res["wall_ms"] = timing.median_time(fn, *args, warmup=1, repeats=FLAGS.reps)
    if FLAGS.iters:
      res["device_ms"], res["kernels"] = device_ms(fn, args, FLAGS.iters)
    if row == "mosaic_c64" and reference is not None:
      res["max_rel_err_vs_triton_c64"] = max_rel_err(o, reference)
    return res, o
  except Exception as e:  # pylint: disable=broad-except
    res["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(f"{row} T={t} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return res, None


def table(rows):
  fmt = lambda x, f: "" if x is None else f.format(x)
  body = [[r["row"], r["T"], r["chunk"], fmt(r.get("wall_ms"), "{:.3f}"),
           fmt(r.get("device_ms"), "{:.3f}"), fmt(r.get("max_rel_err_vs_triton_c64"), "{:.2e}"),
           r.get("error", "")[:120]] for r in rows]
  return timing.markdown_table(["row", "T", "chunk", "wall ms", "device ms",
                                "max rel err vs triton c64", "error"], body)


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.rows) - set(ROWS))
  if unknown:
    sys.exit(f"benchmark_output_stage: unknown --rows {unknown}; choose from {sorted(ROWS)}")
  if "mosaic_c64" in FLAGS.rows:
    try:
      output_mgpu.check_backend(FLAGS.interpret)
    except output_mgpu.MosaicGPUUnavailable as e:
      sys.exit(f"benchmark_output_stage: cannot run the Mosaic GPU row here: {e}\n"
               "(run it on a Hopper GPU, or pass --interpret for a CPU check of the script)")
  rows = []
  for t in map(int, FLAGS.seq_lens):
    reference = None
    for row in FLAGS.rows:
      res, o = run_row(row, t, FLAGS.interpret, reference)
      if row == "triton_c64":
        reference = o
      rows.append(res)
      print(f"{row} T={t}: " + ", ".join(f"{k}={v}" for k, v in res.items()
                                         if k not in ("row", "T")), flush=True)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "settings": dict(batch=FLAGS.batch, heads=FLAGS.heads, dim=FLAGS.dim,
                             dtype="bfloat16", reps=FLAGS.reps, iters=FLAGS.iters,
                             interpret=FLAGS.interpret),
            "rows": rows}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  write_json(FLAGS.out, result)
  print(f"\noutput stage, B={FLAGS.batch} H={FLAGS.heads} K=V={FLAGS.dim} bf16, "
        f"{result['device']}, jax {result['jax']}\n")
  print(table(rows))
  print(f"\nwrote {FLAGS.out}")
  if any("error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
