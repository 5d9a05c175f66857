"""The Moebius map application the gain's forward replays share: a chunk's carry-in is p0
pushed through the reduce's chunk maps (kernel.py), p <- (m11 p + m12) / (m21 p + m22). Scale-free
in the map's matrix, so the reduce may renormalise it by any power of two (kernel.py, _matmul2)."""

from __future__ import annotations

from jax import lax


def apply_maps(load_map, p, n):
  """p through maps 0 .. n-1 in order; load_map(j) = (m11, m12, m21, m22), each broadcastable
  against p (lane rows: the lane replay's channels, the scalar replay's heads)."""

  def body(j, p):
    m11, m12, m21, m22 = load_map(j)
    return (m11 * p + m12) / (m21 * p + m22)

  return lax.fori_loop(0, n, body, p)
