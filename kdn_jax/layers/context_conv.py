"""The short convolution with T split over the context axis (kdn_jax.ops.context_parallel).

Under an active `sequence_sharding`, each device convolves its slice with a halo: the previous
slice's last W-1 inputs (and segment ids), passed by one `ppermute`; the first slice's halo is the
given cache. Left to XLA, the T-sharded concatenate-and-slice of `ShortConv` is resharded with
all-to-alls of the activations instead.

Why the halo is exact with packed segments: `ShortConv` on [halo, slice] numbers positions from the
halo's first token, so a token of a segment that began before the halo never reaches back past it
(its position is >= W-1), and one whose segment began inside the window reaches the cache exactly
as in the unsplit call. The first slice's halo carries the first token's segment id, so reading it
is reading the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdn_jax.ops import context_sharding


def short_conv(conv, x, cache, segment_ids=None, *, fused=False, config=None):
  """``conv(x, cache, segment_ids, fused=fused, config=config)`` (a ShortConv), T split over the active context
  axis when there is one and every slice holds at least W-1 tokens; else the plain call. The split
  path runs the plain-JAX conv (the Pallas one is not wrapped for shard_map)."""
  setting = context_sharding.active_setting()
  halo = conv.width - 1
  if setting is None or halo == 0:
    return conv(x, cache, segment_ids, fused=fused, config=config)
  mesh, axis, batch_axes = setting
  n = mesh.shape[axis]
  B, T = x.shape[:2]
  if T % n or T // n < halo:
    return conv(x, cache, segment_ids, fused=fused, config=config)
  if cache is None:
    cache = conv.init_cache(B)
  seq, per_seq = P(batch_axes, axis), P(batch_axes)
  # The module enters the body as (graphdef, state), so its parameters are the body's own
  # (replicated) inputs rather than tracers of the enclosing jit.
  graphdef, params = nnx.split(conv)

  def body(params, x, cache, seg):
    idx = jax.lax.axis_index(axis)
    to_next = [(i, i + 1) for i in range(n - 1)]
    prev_tail = jax.lax.ppermute(x[:, -halo:], axis, to_next)  # slice 0 receives zeros
    x_ext = jnp.concatenate([jnp.where(idx == 0, cache.astype(x.dtype), prev_tail), x], axis=1)
    seg_ext = None
    if seg is not None:
      prev_ids = jax.lax.ppermute(seg[:, -halo:], axis, to_next)
      first = jnp.broadcast_to(seg[:, :1], prev_ids.shape)
      seg_ext = jnp.concatenate([jnp.where(idx == 0, first, prev_ids), seg], axis=1)
    y, new_cache = nnx.merge(graphdef, params)(x_ext, cache, seg_ext)
    # The sequence's new cache is the last slice's, the same on every device.
    last = jax.lax.psum(jnp.where(idx == n - 1, new_cache, jnp.zeros_like(new_cache)), axis)
    return y[:, halo:], last

  return jax.shard_map(
    body, mesh=mesh, in_specs=(P(), seq, per_seq, seq), out_specs=(seq, per_seq)
  )(params, x, cache, segment_ids)
