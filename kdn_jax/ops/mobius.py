"""Associative scan of Moebius (linear-fractional) maps.

x_t = (a_t x_{t-1} + b_t) / (c_t x_{t-1} + d_t) is the action of the 2x2
matrix M_t = [[a, b], [c, d]] on homogeneous coordinates (n, d), x = n / d.
Composition is the matrix product with the later map on the LEFT, so every
prefix comes out of one `jax.lax.associative_scan` in O(log T) depth.
"""

import jax
import jax.numpy as jnp

Matrix = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _renormalise(m: Matrix) -> Matrix:
  # Products grow or shrink geometrically; x = n/d is invariant to a common
  # scale, so divide by the largest |entry|. The scale carries no gradient
  # (the ratio does not depend on it), which keeps `max` out of the backward.
  a, b, c, d = m
  s = jnp.maximum(jnp.maximum(jnp.abs(a), jnp.abs(b)), jnp.maximum(jnp.abs(c), jnp.abs(d)))
  s = jax.lax.stop_gradient(jnp.where(s > 0, s, jnp.ones_like(s)))
  return a / s, b / s, c / s, d / s


def compose(earlier: Matrix, later: Matrix) -> Matrix:
  """later @ earlier, renormalised: apply `earlier` first, then `later`."""
  a1, b1, c1, d1 = earlier
  a2, b2, c2, d2 = later
  return _renormalise((a2 * a1 + b2 * c1, a2 * b1 + b2 * d1, c2 * a1 + d2 * c1, c2 * b1 + d2 * d1))


def prefix_products(m: Matrix, *, axis: int = 1, reverse: bool = False) -> Matrix:
  """Inclusive prefix compositions M_t o ... o M_1 (renormalised)."""
  return jax.lax.associative_scan(compose, _renormalise(m), reverse=reverse, axis=axis)


def apply(m: Matrix, x: jax.Array) -> jax.Array:
  a, b, c, d = m
  return (a * x + b) / (c * x + d)


def mobius_scan(a, b, c, d, x0, *, axis: int = 1, reverse: bool = False):
  """All x_t of x_t = (a_t x_{t-1} + b_t) / (c_t x_{t-1} + d_t), inclusive.

  Args:
    a, b, c, d: arrays of one shape, time along `axis`.
    x0: the value before the first step; broadcastable to the shape of `a`
      with `axis` removed (e.g. [B, H, K] for a [B, T, H, K] scan on axis 1).
    axis: the time axis.
    reverse: scan from the end (x0 then is the value after the last step).

  Returns:
    x with the shape of `a`: x_t for every t. Differentiable; entries of the
    running products are renormalised so the scan stays finite for very long
    sequences of contracting or expanding maps.
  """
  shapes = {jnp.shape(t) for t in (a, b, c, d)}
  if len(shapes) != 1:
    raise ValueError(f"mobius_scan: a, b, c, d must have one shape, got {shapes}")
  shape = jnp.shape(a)
  axis = axis % len(shape)
  out_shape = shape[:axis] + shape[axis + 1 :]
  try:
    x0 = jnp.broadcast_to(jnp.asarray(x0), out_shape)
  except ValueError as e:
    raise ValueError(
      f"mobius_scan: x0 of shape {jnp.shape(x0)} does not "
      f"broadcast to {out_shape} (a's shape without axis "
      f"{axis})"
    ) from e
  dtype = jnp.result_type(a, b, c, d, x0)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"mobius_scan: expected floating inputs, got {dtype}")
  m = tuple(jnp.asarray(t, dtype) for t in (a, b, c, d))
  prefix = prefix_products(m, axis=axis, reverse=reverse)
  return apply(prefix, jnp.expand_dims(x0.astype(dtype), axis))
