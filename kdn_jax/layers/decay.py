"""KDA-style data-dependent decay: log_alpha = -exp(A_log) * softplus(f(x) + dt_bias).

``per_channel=True``: f is low rank d -> rank -> H*K and dt_bias is [H, K] (KDA / KDN / GDN-2 / GLA).
``per_channel=False``: f is d -> H and dt_bias is [H] (Gated DeltaNet, Mamba-2 style).
A_log ~ log U(a_min, a_max); dt ~ logU(dt_min, dt_max), dt_bias = softplus^{-1}(dt). The ranges are
the model config keys a_min, a_max, dt_min, dt_max (defaults [1, 16] and [1e-3, 1e-1], Mamba-2's):
at f = 0 a channel's time constant 1 / (A dt) then lies in [1 / (a_max dt_max), 1 / (a_min dt_min)].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.dense import Dense, LowRank, make_param
from kdn_jax.layers.options import option

DECAY_KEYS = ("a_min", "a_max", "dt_min", "dt_max")
DT_FLOOR = 1e-4


def decay_ranges(cfg) -> dict:
  """A model config's decay initialisation as Decay's keywords (configs saved before the keys
  existed get the defaults)."""
  v = {k: float(option(cfg, k)) for k in DECAY_KEYS}
  return {"a_range": (v["a_min"], v["a_max"]), "dt_range": (v["dt_min"], v["dt_max"])}


def a_log_init(a_min, a_max):
  def init(key, shape, dtype):
    a = jax.random.uniform(key, shape, jnp.float32, a_min, a_max)
    return jnp.log(a).astype(dtype)

  return init


def dt_bias_init(dt_min, dt_max, floor=None):
  """softplus^-1 of dt ~ logU(dt_min, dt_max) floored at ``floor``. None: DT_FLOOR where it is
  below the range (it guards the inverse softplus, the log of a tiny expm1, and never binds), else
  dt_min; mamba_ssm's Mamba2 floors at DT_FLOOR always (a range reaching below it gets raised)."""
  dt_floor = min(DT_FLOOR, dt_min) if floor is None else float(floor)

  def init(key, shape, dtype):
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus

  return init


class Decay(nnx.Module):
  def __init__(
    self,
    d_model: int,
    num_heads: int,
    head_dim: int,
    *,
    per_channel: bool = True,
    rank: int | None = None,
    a_range=(1.0, 16.0),
    dt_range=(1e-3, 1e-1),
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.per_channel = per_channel
    H, K = num_heads, head_dim
    if per_channel:
      self.f = LowRank(
        d_model,
        rank or head_dim,
        (H, K),
        ("heads", "kv"),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
      )
      self.dt_bias = make_param(rngs, dt_bias_init(*dt_range), (H, K), param_dtype, ("heads", "kv"))
    else:
      self.f = Dense(
        d_model, H, ("embed", "heads"), dtype=dtype, param_dtype=param_dtype, rngs=rngs
      )
      self.dt_bias = make_param(rngs, dt_bias_init(*dt_range), (H,), param_dtype, ("heads",))
    self.A_log = make_param(rngs, a_log_init(*a_range), (H,), param_dtype, ("heads",))

  def __call__(self, x):
    """x [..., d] -> log_alpha float32 [..., H, K] (per channel) or [..., H]."""
    return self.log_alpha_and_dt(x)[0]

  def log_alpha_and_dt(self, x):
    """x [..., d] -> (log_alpha, dt), both float32 of the same shape, log_alpha = -exp(A_log) * dt,
    dt = softplus(f(x) + dt_bias) (the Mamba-2 step size, also used to scale the input)."""
    return self.activate(self.f(x))

  def activate(self, f):
    """f = self.f(x) (the projection before its activation) -> (log_alpha, dt), float32.
    The reference of the fused front-end in pallas_kernels.kdn_gain (*_gain_fused)."""
    f = f.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    A = jnp.exp(self.A_log[...].astype(jnp.float32))
    if self.per_channel:
      A = A[:, None]
    dt = jax.nn.softplus(f)
    return -A * dt, dt
