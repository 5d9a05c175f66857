"""pallas_kernels.gated_norm (CPU interpret mode) against the layer's plain-JAX gated RMSNorm
(kdn_jax.layers.gated_norm.GatedRMSNorm): outputs and the gradients of o, gate and weight; T not a
multiple of the block, T = 1, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdn_jax.layers.gated_norm import rms_norm
from pallas_kernels.gated_norm import gated_rms_norm

EPS = 1e-6


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30)))


def _reference(o, g, w):  # GatedRMSNorm.__call__ with dtype = o's
  return (rms_norm(o, w, EPS) * jax.nn.sigmoid(g.astype(jnp.float32))).astype(o.dtype)


@pytest.mark.parametrize("t,dtype", [(37, jnp.float32), (1, jnp.bfloat16), (20, jnp.bfloat16)])
def test_gated_rms_norm_matches_composition(t, dtype):
  rng = np.random.default_rng(t)
  shape = (2, t, 3, 32)
  o, g, ct = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
  o, g = o.astype(dtype), (2 * g).astype(dtype)
  w = jnp.asarray(1 + 0.3 * rng.normal(size=(32,)), jnp.float32)

  def run(fn):
    def f(o, g, w):
      y, vjp = jax.vjp(fn, o, g, w)
      return y, vjp(ct.astype(y.dtype))

    return jax.jit(f)(o, g, w)

  (y, grads), (y_ref, grads_ref) = run(lambda *a: gated_rms_norm(*a, EPS)), run(_reference)
  tol = 1e-6 if dtype == jnp.float32 else 4e-3  # bf16: one rounding of the same fp32 values
  assert y.dtype == y_ref.dtype and _rel(y, y_ref) <= tol, _rel(y, y_ref)
  for name, x, r in zip(("o", "gate", "weight"), grads, grads_ref):
    assert x.dtype == r.dtype and x.shape == r.shape, name
    assert _rel(x, r) <= (1e-5 if dtype == jnp.float32 else 4e-3), (name, _rel(x, r))
