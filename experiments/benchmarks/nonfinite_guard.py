"""What the non-finite guard of the ops (kdn_jax/ops/nonfinite.py) costs: forward and forward+backward
time of diag_kdn, iso_kdn and delta_rule under each guard scheme, in one process.

    python -m experiments.benchmarks.nonfinite_guard --impl=pallas --b=4 --t=4096,16384 --h=16 \
      --d=128 --out=/tmp/guard.json

Schemes (nonfinite.SCHEMES): "none" (no guard, the baseline: not contained), "outputs" (the ops'
default on the Pallas path: the outputs checked finite and log_alpha above its floor, the guarded
path only when a check fails) and "inputs" (nonfinite.Guard on every call: clean copies of every
input, an all-finite reduction over them, a select on the outputs). --gate_in_jit forms log_alpha inside the timed function from
a raw gate (-softplus), as a layer does, so the guard's read of it can fuse into the op making it;
without it log_alpha is an argument and the guard's check over it a pass of its own. Each cell
also gives the compiled program's temporary memory (MB).
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
_T = flags.DEFINE_list("t", ["4096"], "sequence lengths (each its own inputs and programs)")
_H = flags.DEFINE_integer("h", 8, "heads")
_D = flags.DEFINE_integer("d", 128, "key and value width")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v dtype")
_OPS = flags.DEFINE_list("ops", ["diag_kdn", "iso_kdn", "delta_rule"], "ops to time")
_SCHEMES = flags.DEFINE_list("schemes", list(nonfinite.SCHEMES), "guard schemes to time")
_GATE_IN_JIT = flags.DEFINE_bool("gate_in_jit", False, "form log_alpha inside the timed function")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per cell")
_OUT = flags.DEFINE_string("out", "", "JSON file for the table (optional)")


def _args(b, t, h, d, dtype):
  ks = jax.random.split(jax.random.PRNGKey(0), 7)
  q, k, v = (jax.random.normal(x, (b, t, h, d), jnp.float32).astype(dtype) for x in ks[:3])
  k = k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True).astype(dtype)
  gate = jax.random.normal(ks[3], (b, t, h, d))  # log_alpha = -softplus(gate)
  om = 0.1 * jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d)))
  r = 1.0 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))
  seg = jnp.cumsum(jax.random.bernoulli(ks[6], 1 / 512, (b, t)), axis=1).astype(jnp.int32)
  return q, k, v, gate, om, r, seg


def _fns(op, impl, scheme, gate_in_jit):
  def fwd(q, k, v, la, om, r, seg):
    with nonfinite.scheme(scheme):
      if gate_in_jit:
        la = -jax.nn.softplus(la)
      if op == "diag_kdn":
        return ops.diag_kdn(q, k, v, la, om, r, segment_ids=seg, impl=impl)[0]
      if op == "iso_kdn":
        return ops.iso_kdn(q, k, v, la, om[..., 0], r, segment_ids=seg, impl=impl)[0]
      return ops.delta_rule(q, k, v, la, om * k, segment_ids=seg, impl=impl)[0]

  def loss(*a):
    return jnp.sum(fwd(*a).astype(jnp.float32) ** 2)

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _temp_mb(fn, args):
  """The compiled program's temporary buffers (MB): what a guard's fallback branch adds to the
  peak; NaN where the backend does not say."""
  analysis = fn.lower(*args).compile().memory_analysis()
  return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def _time_length(t, dtype, schemes, rows, out):
  """Times every op x scheme at length ``t``; appends table rows and JSON rows."""
  args = list(_args(_B.value, t, _H.value, _D.value, dtype))
  if not _GATE_IN_JIT.value:
    args[3] = -jax.nn.softplus(args[3])
  for op in _OPS.value:
    times, temp = {}, {}
    for scheme in schemes:
      fwd, grad = _fns(op, _IMPL.value, scheme, _GATE_IN_JIT.value)
      times[scheme] = (
        median_time(fwd, *args, repeats=_REPEATS.value),
        median_time(grad, *args, repeats=_REPEATS.value),
      )
      temp[scheme] = _temp_mb(fwd, args), _temp_mb(grad, args)
    for i, what in enumerate(("fwd", "fwd+bwd")):
      base = times["none"][i]
      cells = [f"{base:.3f} [{temp['none'][i]:.0f}]"]
      for scheme in schemes[1:]:
        ms = times[scheme][i]
        cells.append(f"{ms:.3f} ({100 * (ms / base - 1):+.1f}%) [{temp[scheme][i]:.0f}]")
      rows.append([op, t, what, *cells])
      out.append(
        dict(
          op=op,
          t=t,
          pass_=what,
          **{f"{s}_ms": times[s][i] for s in schemes},
          **{f"{s}_temp_mb": temp[s][i] for s in schemes},
        )
      )


def main(argv):
  del argv
  lengths = [int(x) for x in _T.value]
  if not lengths or min(lengths) < 1:
    raise app.UsageError(f"--t: expected positive sequence lengths, got {_T.value}")
  dtype = jnp.dtype(_DTYPE.value)
  schemes = ["none"] + [s for s in _SCHEMES.value if s != "none"]
  rows, out = [], []
  for t in lengths:
    _time_length(t, dtype, schemes, rows, out)
  print(
    f"{jax.devices()[0].device_kind}, impl={_IMPL.value}, B={_B.value} T={lengths} H={_H.value} "
    f"K=V={_D.value} {_DTYPE.value}, gate_in_jit={_GATE_IN_JIT.value}"
  )
  print(markdown_table(["op", "T", "pass", *(f"{s}: ms [temp MB]" for s in schemes)], rows))
  if _OUT.value:
    settings = dict(b=_B.value, t=lengths, h=_H.value, d=_D.value, dtype=_DTYPE.value)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(
        dict(
          device=jax.devices()[0].device_kind,
          impl=_IMPL.value,
          gate_in_jit=_GATE_IN_JIT.value,
          settings=settings,
          schemes=schemes,
          rows=out,
        ),
        f,
        indent=1,
      )


if __name__ == "__main__":
  app.run(main)
