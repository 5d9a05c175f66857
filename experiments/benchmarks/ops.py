r"""Times kdn_jax.ops implementations: reference vs chunked (and pallas where
available), forward and forward+backward.

  python -m experiments.benchmarks.ops --seq_lens=1024,4096,16384 \
      --out=/tmp/bench_ops.json

Prints a Markdown table; writes JSON when --out is given.
"""

import json
import platform

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.benchmarks.timing import markdown_table, median_time
from kdn_jax import ops

FLAGS = flags.FLAGS
flags.DEFINE_list("seq_lens", ["1024", "4096", "16384"], "Sequence lengths T.")
flags.DEFINE_list("impls", ["reference", "chunked"], "Implementations.")
flags.DEFINE_list("ops", ["diag_kdn"], "diag_kdn, iso_kdn, kda or gated_delta_rule.")
flags.DEFINE_integer("batch", 1, "B.")
flags.DEFINE_integer("heads", 4, "H.")
flags.DEFINE_integer("key_dim", 64, "K.")
flags.DEFINE_integer("value_dim", 64, "V.")
flags.DEFINE_integer("chunk_size", None, "Chunk length for chunked/pallas (default: per platform).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
flags.DEFINE_integer("repeats", 5, "Timed runs per cell (median reported).")
flags.DEFINE_string("out", None, "Optional JSON output path.")


def make_args(op, b, t, h, kd, vd, dtype):
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  n = lambda i, *s: jax.random.normal(keys[i], s, jnp.float32)
  k = n(1, b, t, h, kd)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  q, v = n(0, b, t, h, kd) / kd**0.5, n(2, b, t, h, vd)
  la = -jax.nn.softplus(n(3, b, t, h, kd) - 3.0)
  cast = lambda *xs: tuple(x.astype(dtype) for x in xs)
  if op == "diag_kdn":
    return cast(
      q, k, v, la, 0.01 * jax.nn.softplus(n(4, b, t, h, kd)), 0.01 + jax.nn.softplus(n(5, b, t, h))
    )
  if op == "iso_kdn":
    return cast(
      q, k, v, la, 0.01 * jax.nn.softplus(n(4, b, t, h)), 0.01 + jax.nn.softplus(n(5, b, t, h))
    )
  beta = jax.nn.sigmoid(n(6, b, t, h))
  if op == "kda":
    return cast(q, k, v, la, beta)
  if op == "gated_delta_rule":
    return cast(q, k, v, la[..., 0], beta)
  raise ValueError(f"--ops: unknown op {op!r}")


def time_cell(op, impl, args, chunk_size, repeats):
  fn = getattr(ops, op)
  fwd = jax.jit(lambda *a: fn(*a, impl=impl, chunk_size=chunk_size)[0])
  loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) ** 2)
  fwd_bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
  return (median_time(fwd, *args, repeats=repeats), median_time(fwd_bwd, *args, repeats=repeats))


def main(argv):
  del argv
  dtype = jnp.dtype(FLAGS.dtype)
  device = jax.devices()[0]
  results, rows = [], []
  cells = [(op, int(t), impl) for op in FLAGS.ops for t in FLAGS.seq_lens for impl in FLAGS.impls]
  for i, (op, t, impl) in enumerate(cells):
    args = make_args(op, FLAGS.batch, t, FLAGS.heads, FLAGS.key_dim, FLAGS.value_dim, dtype)
    fwd_ms, fb_ms = time_cell(op, impl, args, FLAGS.chunk_size, FLAGS.repeats)
    results.append(dict(op=op, impl=impl, T=t, forward_ms=fwd_ms, forward_backward_ms=fb_ms))
    print(
      f"[{i + 1}/{len(cells)}] {op} {impl} T={t}: fwd {fwd_ms:.2f} ms, fwd+bwd {fb_ms:.2f} ms",
      flush=True,
    )
  base = {(r["op"], r["T"]): r for r in results if r["impl"] == "reference"}
  for r in results:
    ref = base.get((r["op"], r["T"]))
    speed = f"{ref['forward_backward_ms'] / r['forward_backward_ms']:.1f}x" if ref else "-"
    rows.append(
      [
        r["op"],
        r["impl"],
        r["T"],
        f"{r['forward_ms']:.2f}",
        f"{r['forward_backward_ms']:.2f}",
        speed,
      ]
    )
  print(
    f"\nDevice: {device.device_kind} ({jax.default_backend()}), jax "
    f"{jax.__version__}, B={FLAGS.batch} H={FLAGS.heads} K={FLAGS.key_dim}"
    f" V={FLAGS.value_dim} {FLAGS.dtype}, median of {FLAGS.repeats}\n"
  )
  print(
    markdown_table(
      ["op", "impl", "T", "fwd ms", "fwd+bwd ms", "fwd+bwd speed-up vs reference"], rows
    )
  )
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(
        dict(
          device=device.device_kind,
          backend=jax.default_backend(),
          host=platform.node(),
          jax=jax.__version__,
          config={
            k: FLAGS[k].value
            for k in ("batch", "heads", "key_dim", "value_dim", "dtype", "chunk_size", "repeats")
          },
          results=results,
        ),
        f,
        indent=1,
      )


if __name__ == "__main__":
  app.run(main)
