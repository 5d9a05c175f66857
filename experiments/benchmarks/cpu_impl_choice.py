"""Compile and run time of each op implementation on the CPU: the measurement behind impl='auto''s choice
there (kdn_jax/ops/dispatch.py, AUTO_BY_PLATFORM).

    python -m experiments.benchmarks.cpu_impl_choice --T=4096 --ops=diag_kdn,gated_delta_rule

For each op and impl: the first call of a jitted forward (and forward + backward) -- tracing plus XLA's
compile plus one run -- and the median of ``--repeats`` later runs. Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

_T = flags.DEFINE_integer("T", 4096, "Sequence length.")
_B = flags.DEFINE_integer("B", 1, "Batch.")
_H = flags.DEFINE_integer("H", 2, "Heads.")
_K = flags.DEFINE_integer("K", 32, "Key width (and value width).")
_OPS = flags.DEFINE_list("ops", ["diag_kdn", "gated_delta_rule"], "Ops to time.")
_IMPLS = flags.DEFINE_list("impls", ["reference", "chunked"], "Implementations to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs after the first.")
_GRAD = flags.DEFINE_bool("grad", True, "Also time forward + backward.")


def _inputs(op, B, T, H, K, key):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (B, T, H, K))
  k = jax.random.normal(ks[1], (B, T, H, K)) * K**-0.5
  v = jax.random.normal(ks[2], (B, T, H, K))
  if op in ("diag_kdn", "iso_kdn"):
    la = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
    om = jax.nn.softplus(jax.random.normal(ks[4], (B, T, H, K))) * 0.1
    r = jax.nn.softplus(jax.random.normal(ks[5], (B, T, H))) + 0.1
    if op == "iso_kdn":
      la, om = la[..., 0], om[..., 0]
    return (q, k, v, la, om, r)
  g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  return (q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, g, beta)


def measure(
  op: str, impl: str, B: int, T: int, H: int, K: int, repeats: int, grad: bool
) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from kdn_jax import ops  # pylint: disable=g-import-not-at-top

  fn = getattr(ops, op)
  args = _inputs(op, B, T, H, K, jax.random.key(0))

  def fwd(*a):
    return fn(*a, impl=impl)[0]

  progs = {"forward": jax.jit(fwd)}
  if grad:
    progs["forward+backward"] = jax.jit(
      jax.grad(lambda *a: jnp.sum(fwd(*a) ** 2), argnums=(0, 1, 2))
    )
  rows = []
  for what, prog in progs.items():
    t0 = time.perf_counter()
    jax.block_until_ready(prog(*args))
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(prog(*args))
      runs.append(time.perf_counter() - t0)
    run = statistics.median(runs)
    rows.append(
      {
        "op": op,
        "impl": impl,
        "pass": what,
        "B": B,
        "T": T,
        "H": H,
        "K": K,
        "first_call_s": round(first, 3),
        "compile_s": round(first - run, 3),
        "run_s": round(run, 4),
        "backend": jax.default_backend(),
      }
    )
  return rows


def main(argv):
  del argv
  for op in _OPS.value:
    for impl in _IMPLS.value:
      for row in measure(
        op, impl, _B.value, _T.value, _H.value, _K.value, _REPEATS.value, _GRAD.value
      ):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
