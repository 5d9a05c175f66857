"""What the non-finite guard of the ops (kdn_jax/ops/nonfinite.py) costs: forward and forward+backward
time of diag_kdn and delta_rule with the guard and with it replaced by a pass-through, in one process.

    python -m experiments.benchmarks.nonfinite_guard --impl=pallas --t=4096 --out=/tmp/guard.json

The guard is a few elementwise XLA passes around the kernels (a clean copy of each input, per-token
flags, a select on the outputs); on a GPU they are extra passes over HBM that the kernels' custom
calls cannot fuse, so this measures them.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.benchmarks.timing import markdown_table, median_time
from kdn_jax import ops
from kdn_jax.ops import nonfinite

_IMPL = flags.DEFINE_string("impl", "auto", "ops impl")
_B = flags.DEFINE_integer("b", 8, "batch")
_T = flags.DEFINE_integer("t", 4096, "sequence length")
_H = flags.DEFINE_integer("h", 8, "heads")
_D = flags.DEFINE_integer("d", 128, "key and value width")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v dtype")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per cell")
_OUT = flags.DEFINE_string("out", "", "JSON file for the table (optional)")


class _PassThrough:
  """nonfinite.Guard's interface without its work: the ops as they were before the guard."""

  def __init__(self, q, state, segment_ids, compute_dtype, variance=(), r_names=()):
    del segment_ids, compute_dtype, variance, r_names
    self.inputs = dict(state, q=q)

  def spoil(self, o, memory=None, variance=None):
    return o, memory, variance


def _args(b, t, h, d, dtype):
  ks = jax.random.split(jax.random.PRNGKey(0), 7)
  q, k, v = (jax.random.normal(x, (b, t, h, d), jnp.float32).astype(dtype) for x in ks[:3])
  k = k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True).astype(dtype)
  la = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, d)))
  om = 0.1 * jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d)))
  r = 1.0 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))
  seg = jnp.cumsum(jax.random.bernoulli(ks[6], 1 / 512, (b, t)), axis=1).astype(jnp.int32)
  return q, k, v, la, om, r, seg


def _fns(op, impl):
  def fwd(q, k, v, la, om, r, seg):
    if op == "diag_kdn":
      return ops.diag_kdn(q, k, v, la, om, r, segment_ids=seg, impl=impl)[0]
    return ops.delta_rule(q, k, v, la, om * k, segment_ids=seg, impl=impl)[0]

  def loss(*a):
    return jnp.sum(fwd(*a).astype(jnp.float32) ** 2)

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  args = _args(_B.value, _T.value, _H.value, _D.value, dtype)
  rows, out = [], []
  real_guard = nonfinite.Guard
  for op in ("diag_kdn", "delta_rule"):
    times = {}
    for guarded in (True, False):
      nonfinite.Guard = real_guard if guarded else _PassThrough
      try:
        fwd, grad = _fns(op, _IMPL.value)
        times[guarded] = (
          median_time(fwd, *args, repeats=_REPEATS.value),
          median_time(grad, *args, repeats=_REPEATS.value),
        )
      finally:
        nonfinite.Guard = real_guard
    for i, what in enumerate(("fwd", "fwd+bwd")):
      g, p = times[True][i], times[False][i]
      rows.append([op, what, f"{p:.3f}", f"{g:.3f}", f"{100 * (g / p - 1):+.1f}%"])
      out.append(dict(op=op, pass_=what, without_ms=p, with_ms=g))
  print(
    f"{jax.devices()[0].device_kind}, impl={_IMPL.value}, B={_B.value} T={_T.value} H={_H.value} "
    f"K=V={_D.value} {_DTYPE.value}"
  )
  print(markdown_table(["op", "pass", "without guard (ms)", "with guard (ms)", "cost"], rows))
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, impl=_IMPL.value, rows=out), f, indent=1)


if __name__ == "__main__":
  app.run(main)
