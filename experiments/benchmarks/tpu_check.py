r"""First-TPU-run checks of the Mosaic-TPU kernels (docs/tpu.md): exactness, then timings.

  python -m experiments.benchmarks.tpu_check --mode=check   # impl='pallas' vs impl='chunked', fwd + grads
  python -m experiments.benchmarks.tpu_check --mode=sweep   # fwd+bwd time per (gain block, delta chunk)

`check`: diag_kdn and iso_kdn with impl='pallas' (on a TPU backend: kdn_gain/tpu.py and
delta_rule/tpu_*.py) against impl='chunked' (XLA), outputs, final memory and variance, and the
gradients of every input and of the initial state, with and without packed segments, at
lengths that are not a multiple of any block; exits 1 when an error exceeds its bound (fp32
1e-4, bf16 2e-2 relative). The first thing it tests on real hardware is that Mosaic lowers the
kernels at all (interpret mode checks semantics, not lowering).
`sweep`: diag/iso KDN fwd+bwd medians per GainConfig.max_chunk (the gain's T block) and
DeltaRuleConfig.max_chunk (the delta rule's chunk), chunked XLA alongside.
`--interpret` runs everything in TPU interpret mode (a CPU smoke test of this script only).
Writes JSON to --out when given.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.benchmarks.timing import markdown_table, median_time
from kdn_jax import ops

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "check", ["check", "sweep"], "what to run")
flags.DEFINE_list("seq_lens", ["1000", "4096"], "T (check: not multiples of the blocks)")
flags.DEFINE_integer("batch", 2, "B")
flags.DEFINE_integer("heads", 4, "H")
flags.DEFINE_integer("dim", 128, "K = V")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "input dtypes")
flags.DEFINE_list("gain_blocks", ["64", "128", "256"], "sweep: GainConfig.max_chunk values")
flags.DEFINE_list("chunks", ["16", "32", "64"], "sweep: DeltaRuleConfig.max_chunk values")
flags.DEFINE_integer("repeats", 10, "sweep: timed runs per cell (median)")
flags.DEFINE_boolean("interpret", False, "TPU interpret mode (CPU smoke test)")
flags.DEFINE_string("out", None, "JSON output path")

TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _inputs(diag, b, t, h, d, dtype, seed=0):
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  x = [
    unit(n(b, t, h, d)),
    unit(n(b, t, h, d)),
    n(b, t, h, d),
    -np.log1p(np.exp(n(b, t, h, d) - 1.0)),
    0.1 * np.log1p(np.exp(n(*((b, t, h, d) if diag else (b, t, h))))),
    0.01 + np.log1p(np.exp(n(b, t, h))),
  ]
  state = (0.3 * n(b, h, d, d), 0.2 + rng.random((b, h, d) if diag else (b, h)))
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
  return [cast(a) for a in x], [jnp.asarray(s, jnp.float32) for s in state]


def _segments(b, t):
  seg = np.zeros((b, t), np.int32)
  for s in (t // 3, t // 3 + 1, (2 * t) // 3):
    seg[0, s:] += 1
  return jnp.asarray(seg)


def _loss_and_grads(diag, impl, seg, xs, state):
  fn = ops.diag_kdn if diag else ops.iso_kdn
  d = xs[0].shape[-1]

  def run(*args):
    *x, mem, var = args
    o, st = fn(
      *x,
      info_scale=float(d),
      initial_state=ops.KDNState(mem, var),
      output_final_state=True,
      segment_ids=seg,
      impl=impl,
    )
    return o, st.memory, st.variance

  def loss(*args):
    o, mem, var = run(*args)
    w = lambda a, i: jnp.cos(jnp.arange(a.size).reshape(a.shape) * 0.37 + i)
    return (
      jnp.sum(w(o, 0) * o.astype(jnp.float32)) + jnp.sum(w(mem, 1) * mem) + jnp.sum(w(var, 2) * var)
    )

  args = tuple(xs) + tuple(state)
  outs = jax.jit(run)(*args)
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
  return outs, grads


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check():
  names = (
    "o",
    "memory",
    "variance",
    "dq",
    "dk",
    "dv",
    "dlog_alpha",
    "domega",
    "dr",
    "dmemory0",
    "dvariance0",
  )
  rows, worst_ok = [], True
  for op, diag in (("diag_kdn", True), ("iso_kdn", False)):
    for dt in FLAGS.dtypes:
      for t in map(int, FLAGS.seq_lens):
        for segmented in (False, True):
          xs, state = _inputs(diag, FLAGS.batch, t, FLAGS.heads, FLAGS.dim, jnp.dtype(dt))
          seg = _segments(FLAGS.batch, t) if segmented else None
          got = _loss_and_grads(diag, "pallas", seg, xs, state)
          want = _loss_and_grads(diag, "chunked", seg, xs, state)
          errs = [_rel(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
          ok = max(errs) <= TOL[dt]
          worst_ok &= ok
          rows.append(
            dict(op=op, dtype=dt, T=t, segments=segmented, ok=ok, errors=dict(zip(names, errs)))
          )
          print(
            f"{op} {dt} T={t} seg={segmented}: max rel err {max(errs):.2e} "
            f"({names[int(np.argmax(errs))]}) {'ok' if ok else 'FAIL'}",
            flush=True,
          )
  return rows, worst_ok


def sweep():
  from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

  rows = []
  for op, diag in (("diag_kdn", True), ("iso_kdn", False)):
    fn = ops.diag_kdn if diag else ops.iso_kdn
    for dt in FLAGS.dtypes:
      for t in map(int, FLAGS.seq_lens):
        xs, _ = _inputs(diag, FLAGS.batch, t, FLAGS.heads, FLAGS.dim, jnp.dtype(dt))
        specs = [("chunked", None, None)] + [
          ("pallas", int(g), int(c)) for g in FLAGS.gain_blocks for c in FLAGS.chunks
        ]
        for impl, gblock, chunk in specs:
          kernels = None
          if impl == "pallas":
            kernels = tuned.KernelConfigs(
              delta_rule=dataclasses.replace(tuned.tuned("delta_rule"), max_chunk=chunk),
              gain=dataclasses.replace(tuned.tuned("gain"), max_chunk=gblock),
            )
          kw = dict(impl=impl, chunk_size=64, kernel_config=kernels)
          loss = lambda *a, kw=kw: jnp.sum(fn(*a, **kw)[0].astype(jnp.float32))
          fwd = jax.jit(lambda *a, kw=kw: fn(*a, **kw)[0])
          fb = jax.jit(jax.grad(loss, argnums=tuple(range(len(xs)))))
          f_ms = median_time(fwd, *xs, repeats=FLAGS.repeats)
          fb_ms = median_time(fb, *xs, repeats=FLAGS.repeats)
          rows.append(
            dict(
              op=op,
              dtype=dt,
              T=t,
              impl=impl,
              gain_block=gblock,
              chunk=chunk,
              forward_ms=f_ms,
              fwd_bwd_ms=fb_ms,
            )
          )
          print(
            f"{op} {dt} T={t} {impl} gain_block={gblock} chunk={chunk}: fwd {f_ms:.2f} "
            f"ms, fwd+bwd {fb_ms:.2f} ms",
            flush=True,
          )
  print(
    markdown_table(
      ["op", "dtype", "T", "impl", "gain block", "chunk", "fwd ms", "fwd+bwd ms"],
      [
        [
          r["op"],
          r["dtype"],
          r["T"],
          r["impl"],
          r["gain_block"],
          r["chunk"],
          f"{r['forward_ms']:.2f}",
          f"{r['fwd_bwd_ms']:.2f}",
        ]
        for r in rows
      ],
    )
  )
  return rows, True


def main(argv):
  del argv
  print(f"backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
  run = check if FLAGS.mode == "check" else sweep
  if FLAGS.interpret:
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      rows, ok = run()
  else:
    rows, ok = run()
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(
        dict(
          mode=FLAGS.mode,
          backend=jax.default_backend(),
          devices=[str(d) for d in jax.devices()],
          rows=rows,
          flags={
            k: FLAGS[k].value for k in ("seq_lens", "batch", "heads", "dim", "dtypes", "interpret")
          },
        ),
        f,
        indent=1,
      )
  if not ok:
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
