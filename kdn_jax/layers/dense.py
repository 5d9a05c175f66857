"""Parameter helpers and a general dense (einsum) layer with logical-axis sharding metadata.

Every parameter in kdn_jax carries ``out_sharding`` metadata made of *logical* axis names
(sharding.LOGICAL_AXES). The runner maps them to mesh axes, e.g.::

    with nnx.logical_axis_rules(logical_axis_rules()):
        pspecs = nnx.get_partition_spec(nnx.state(model))

Parameters are created with ``eager_sharding=False`` so that building a model never needs a mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.sharding import LOGICAL_AXES, logical_axis_rules  # noqa: F401

Initializer = Callable[[jax.Array, tuple, jnp.dtype], jax.Array]


def make_param(
  rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int], dtype, names: Sequence[str | None]
) -> nnx.Param:
  """Create an ``nnx.Param`` with logical-axis sharding metadata."""
  shape = tuple(int(s) for s in shape)
  names = tuple(names)
  if len(names) != len(shape):
    raise ValueError(f"sharding names {names} do not match shape {shape}")
  for n in names:
    if n not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis name {n!r}; use one of {LOGICAL_AXES}")
  key = rngs.params() if rngs is not None else None
  value = init(key, shape, dtype)
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def zeros_init(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)


def ones_init(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


def constant_init(c: float) -> Initializer:
  def init(key, shape, dtype):
    del key
    return jnp.full(shape, c, dtype)

  return init


def normal_init(std: float) -> Initializer:
  def init(key, shape, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

  return init


def uniform_init(bound: float) -> Initializer:
  """U(-bound, bound): with bound = fan_in^-1/2, PyTorch's default for nn.Linear / nn.Conv1d
  weights and biases (kaiming_uniform with a = sqrt(5))."""

  def init(key, shape, dtype):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

  return init


def fan_in_init(fan_in: int, gain: float = 1.0) -> Initializer:
  """Truncated-free normal with std gain / sqrt(fan_in) (LeCun normal)."""
  return normal_init(gain / math.sqrt(max(fan_in, 1)))


def inv_softplus(x: float) -> float:
  return float(x + math.log(-math.expm1(-x)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot_low_precision(x, w, dims, out_dtype):
  return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=out_dtype)


def _dot_low_precision_fwd(x, w, dims, out_dtype):
  return _dot_low_precision(x, w, dims, out_dtype), (x, w)


def _dot_low_precision_bwd(dims, out_dtype, res, ct):
  del out_dtype
  x, w = res
  # A float32 output's cotangent is rounded to the operands' dtype: left float32, it would turn both
  # backward matmuls into float32 x bf16 products, which XLA runs as float32 (TF32) GEMMs: measured on
  # the H200, 13.9 of a KDN layer's 56 ms fwd+bwd at T=16k. Accumulation stays float32 in the GEMMs.
  _, vjp = jax.vjp(
    lambda a, b: jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=x.dtype), x, w
  )
  return vjp(ct.astype(x.dtype))


_dot_low_precision.defvjp(_dot_low_precision_fwd, _dot_low_precision_bwd)


def project(x: jax.Array, w: jax.Array, dims, out_dtype=jnp.float32) -> jax.Array:
  """``dot_general(x, w)`` contracting ``dims`` (no batch dims), accumulated in float32 and returned
  in ``out_dtype`` (float32, or the operands' dtype: the GEMM rounds its float32 accumulator once
  on output, the same values as casting a float32 result, without writing that result and reading
  it back). With bf16/fp16 operands the backward's matmuls take bf16/fp16 operands too
  (mixed-precision training); float32 is a plain dot."""
  if x.dtype == jnp.float32 and w.dtype == jnp.float32:
    if jnp.dtype(out_dtype) != jnp.float32:
      raise ValueError(
        f"project: float32 operands give a float32 output, got out_dtype={out_dtype}"
      )
    return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=jnp.float32)
  if x.dtype != w.dtype:
    raise ValueError(f"project: x and w need one dtype, got {x.dtype} and {w.dtype}")
  if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), x.dtype):
    raise ValueError(
      f"project: out_dtype must be float32 or the operands' {x.dtype}, got {out_dtype}"
    )
  return _dot_low_precision(x, w, tuple(tuple(d) for d in dims), jnp.dtype(out_dtype))


class Dense(nnx.Module):
  """y = x . W (+ b), contracting the trailing ``len(in_shape)`` dims of x with the leading dims of W.

  ``in_shape`` / ``out_shape`` are tuples; ``names`` gives one logical axis name per kernel dim
  (in dims then out dims). Compute happens in ``dtype`` (params are cast), accumulation in f32.
  """

  def __init__(
    self,
    in_shape,
    out_shape,
    names,
    *,
    use_bias=False,
    kernel_init=None,
    bias_init=zeros_init,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
    out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    self.in_shape, self.out_shape = in_shape, out_shape
    self.dtype = dtype
    fan_in = math.prod(in_shape)
    kernel_init = kernel_init or fan_in_init(fan_in)
    self.kernel = make_param(rngs, kernel_init, in_shape + out_shape, param_dtype, names)
    if use_bias:
      self.bias = make_param(rngs, bias_init, out_shape, param_dtype, tuple(names)[len(in_shape) :])
    else:
      self.bias = None

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_shape)
    w = self.kernel[...].astype(self.dtype)
    x = x.astype(self.dtype)
    dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    if self.bias is None:  # (rounded once, by the GEMM)
      return project(x, w, dims, out_dtype=self.dtype)
    y = project(x, w, dims) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class LowRank(nnx.Module):
  """Two-layer low-rank projection d -> rank -> out_shape (second layer optionally with bias)."""

  def __init__(
    self,
    d,
    rank,
    out_shape,
    out_names,
    *,
    use_bias=False,
    zero_second=False,
    bias_init=zeros_init,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.down = Dense(
      d, rank, ("embed", "lowrank"), dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.up = Dense(
      rank,
      out_shape,
      ("lowrank",) + tuple(out_names),
      use_bias=use_bias,
      kernel_init=zeros_init if zero_second else None,
      bias_init=bias_init,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def __call__(self, x):
    return self.up(self.down(x))
