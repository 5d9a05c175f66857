"""SwiGLU MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx

from kdn_jax.layers.dense import Dense


class SwiGLU(nnx.Module):
  def __init__(self, d_model: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = Dense(d_model, hidden, ("embed", "mlp"), **kw)
    self.up = Dense(d_model, hidden, ("embed", "mlp"), **kw)
    self.down = Dense(hidden, d_model, ("mlp", "embed"), **kw)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
