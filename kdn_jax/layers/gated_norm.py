"""RMSNorm, the sigmoid-gated output RMSNorm of the recurrent mixers and Mamba-2's SiLU-gated one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.dense import make_param, ones_init


def rms_norm(x, weight, eps):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return y * weight.astype(jnp.float32)


def silu_gated_rms_norm(y, z, weight, eps, axes=(-1,)):
  """Mamba-2's gated RMSNorm with the gate first (mamba_ssm's RMSNormGated, norm_before_gate=False):
  RMSNorm over ``axes`` of y * SiLU(z), times ``weight`` (broadcast over the leading axes); float32."""
  g = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
  ms = jnp.mean(jnp.square(g), axis=axes, keepdims=True)
  return g * jax.lax.rsqrt(ms + eps) * weight.astype(jnp.float32)


class RMSNorm(nnx.Module):
  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    name: str | None = "embed",
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
  ):
    self.eps, self.dtype = eps, dtype
    self.weight = make_param(None, ones_init, (dim,), param_dtype, (name,))

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps).astype(self.dtype)


class GatedRMSNorm(nnx.Module):
  """y = RMSNorm(o) * sigmoid(gate) over the last (value) dim; weight shared across heads (as in FLA)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs | None = None,
  ):
    self.eps, self.dtype = eps, dtype
    self.weight = make_param(None, ones_init, (dim,), param_dtype, ("kv",))

  def __call__(self, o, gate, *, fused=False, config=None):
    """fused=True: the Pallas kernel (pallas_kernels.gated_norm; config: its NormConfig, None:
    the tuned one), for which this plain-JAX composition is the reference; it returns o's
    dtype, so it is used when that is ours."""
    if fused and o.ndim == 4 and o.dtype == jnp.dtype(self.dtype):
      from pallas_kernels.gated_norm import gated_rms_norm  # pylint: disable=g-import-not-at-top

      return gated_rms_norm(o, gate, self.weight[...], self.eps, config=config)
    y = rms_norm(o, self.weight[...], self.eps) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return y.astype(self.dtype)
