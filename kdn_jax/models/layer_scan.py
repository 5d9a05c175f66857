"""Repeated layers as one ``jax.lax.scan``: the layer body is traced and compiled once.

A 12-layer 125M LM's train step took 96 s to compile on an H200 with the layers unrolled. Layers
whose mixer pattern repeats with period p (all one mixer: p = 1; 'kdn_diag,swa' alternating:
p = 2) are run as a scan over n / p groups of p blocks. Parameters stay stored per layer (the
checkpoint and sharding layout do not change); they are stacked per call, which costs one copy of
the parameters and is differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def pattern_period(names) -> int:
  """Smallest p dividing len(names) with names[i] == names[i % p]; len(names) if none repeats."""
  n = len(names)
  for p in range(1, n + 1):
    if n % p == 0 and all(names[i] == names[i % p] for i in range(n)):
      return p
  return n


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def can_scan(names, states) -> bool:
  """A scan needs >= 2 repeats and, per position in the period, states all given or all None."""
  p = pattern_period(names)
  reps = len(names) // p
  if reps < 2:
    return False
  if states is None:
    return True
  return all(len({states[i * p + j] is None for i in range(reps)}) == 1 for j in range(p))


def scan_blocks(blocks, names, x, states, segment_ids, remat=False):
  """Runs ``x, st_l = blocks[l](x, states[l], segment_ids)`` for every layer l as a scan.

  Returns (x, new_states) like the unrolled loop (new_states: one entry per layer)."""
  n = len(blocks)
  p = pattern_period(names)
  reps = n // p
  states = [None] * n if states is None else list(states)
  graphdefs, params, carried = [], [], []
  for j in range(p):
    parts = [nnx.split(blocks[i * p + j]) for i in range(reps)]
    graphdefs.append(parts[0][0])
    params.append(_stack([s for _, s in parts]))
    group = [states[i * p + j] for i in range(reps)]
    carried.append(None if group[0] is None else _stack(group))

  def body(h, xs):
    layer_params, layer_states = xs
    new = []
    for j in range(p):
      blk = nnx.merge(graphdefs[j], layer_params[j])
      h, st = blk(h, layer_states[j], segment_ids)
      new.append(st)
    return h, new

  if remat:
    body = jax.checkpoint(body)
  x, new_stacked = jax.lax.scan(body, x, (params, carried))
  new_states = [None] * n
  for i in range(reps):
    for j in range(p):
      new_states[i * p + j] = jax.tree.map(lambda a, i=i: a[i], new_stacked[j])
  return x, new_states
