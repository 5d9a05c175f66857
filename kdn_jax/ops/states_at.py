"""The recurrent state after chosen positions: the ops' `output_states_at`.

Position p in [1, T] names the state after the first p tokens (what the op's final state would be
on x[:, :p], segments included). The chunked and Pallas state passes already hold the state
entering every chunk of C tokens; the state after p is

  * at a chunk end (p a multiple of C) or at p = T: that chunk-start state (or the final state);
  * inside a chunk: the chunk-start state advanced through the chunk's tokens before p, one chunk
    of the chunked XLA form per such position (tokens at or after p are made identities: no
    decay, no write), so the cost is P chunks, not a second pass over T.

With segment_ids a segment that restarts inside that window (at or before p - 1) starts from the
op's initial state, and the tokens before the restart are identities. The reference impl keeps
every token's state and gathers. Positions are static (known when tracing): the output's shape
depends on their number, and their values are checked before any work.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kdn_jax.ops.delta_chunked import delta_rule_chunked
from kdn_jax.ops.delta_reference import scalar_write
from kdn_jax.ops.variance import segment_starts

# Chunk of the chunked form inside a window (a window is one state-pass chunk, often 16 tokens).
WINDOW_CHUNK = 16


def check_positions(op, positions, t):
  """output_states_at -> a 1-D int64 numpy array of positions, or None.

  One clear error naming the argument for a traced array, a wrong rank or dtype, an empty array,
  a value outside [1, T] or positions not in ascending order."""
  if positions is None:
    return None
  name = f"{op}: output_states_at"
  if isinstance(positions, jax.core.Tracer):
    raise TypeError(
      f"{name} must be concrete (a list, tuple or numpy array of ints known when "
      "tracing: the output's shape depends on it), got a traced array"
    )
  arr = np.asarray(positions)
  if arr.ndim != 1 or arr.size == 0:
    raise ValueError(
      f"{name} must be a non-empty 1-D array of positions [P], got shape {arr.shape}"
    )
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
  bad = arr[(arr < 1) | (arr > t)]
  if bad.size:
    raise ValueError(
      f"{name} must lie in [1, T] = [1, {t}] (the state after the first p tokens), "
      f"got {bad.tolist()[:5]}"
    )
  if np.any(np.diff(arr) < 0):
    raise ValueError(f"{name} must be sorted in ascending order, got {arr.tolist()[:10]}")
  return arr.astype(np.int64)


def gather_tokens(x, positions):
  """x [B, T, ...] at tokens positions - 1 -> [B, P, ...] (the values after each position)."""
  return jnp.take(x, jnp.asarray(positions - 1), axis=1)


def memory_at(positions, chunk, chunk_states, final, k, v, log_alpha, write, memory0, segment_ids):
  """The memory after each position: [B, P, H, K, V].

  positions: check_positions' array; chunk_states [B, H, N, K, V]: the state entering each chunk
  of `chunk` tokens (before any reset at its first token), N >= ceil(T / chunk); final
  [B, H, K, V]: the state after token T; k, v, log_alpha ([B, T, H, K] or [B, T, H]), write
  ([B, T, H, K], or [B, T, H]: write = beta k) and memory0 [B, H, K, V] (the initial state,
  where segments restart) as the op ran them.
  """
  t = k.shape[1]
  dtype = final.dtype
  at_start = [i for i, p in enumerate(positions) if p != t and p % chunk]
  direct = [i for i in range(len(positions)) if i not in set(at_start)]
  parts, order = [], []
  if direct:
    ps = positions[direct]
    ends = [final if p == t else chunk_states[:, :, p // chunk] for p in ps]
    parts.append(jnp.stack([x.astype(dtype) for x in ends], axis=1))
    order += direct
  if at_start:
    parts.append(
      _window_states(
        positions[at_start], chunk, chunk_states, k, v, log_alpha, write, memory0, segment_ids
      ).astype(dtype)
    )
    order += at_start
  out = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
  if order != sorted(order):
    out = jnp.take(out, jnp.asarray(np.argsort(order)), axis=1)
  return out


def _window_states(positions, chunk, chunk_states, k, v, log_alpha, write, memory0, segment_ids):
  """memory_at for positions inside a chunk: [B, P, H, K, V]."""
  b, t, h, kd = k.shape
  vd = v.shape[-1]
  n_p = len(positions)
  cd = memory0.dtype
  first = (positions - 1) // chunk * chunk  # each window's first token
  idx = first[:, None] + np.arange(chunk)[None, :]  # [P, C]
  keep = jnp.asarray(idx < positions[:, None])[None]  # [1, P, C]: tokens before p
  take = lambda x: jnp.take(x, jnp.asarray(np.minimum(idx, t - 1)), axis=1)  # [B, P, C, ...]
  start = jnp.moveaxis(chunk_states[:, :, first // chunk].astype(cd), 2, 1)  # [B, P, H, K, V]
  if segment_ids is not None:
    resets = take(segment_starts(segment_ids)) & keep
    count = jnp.cumsum(resets, axis=-1)
    # Tokens of p - 1's segment: those from the window's last reset before p on.
    keep = keep & (count == count[..., -1:])
    start = jnp.where(
      (count[..., -1] > 0)[..., None, None, None], memory0[:, None].astype(cd), start
    )
  if write.ndim == 3:
    write = scalar_write(write, k)

  def window(x):
    """x's window tokens, identities outside `keep` (zeros: no decay, no write), as
    [B * P, C, H, ...]: the windows side by side along the batch."""
    y = take(x.astype(cd))
    y = jnp.where(keep.reshape(keep.shape + (1,) * (y.ndim - 3)), y, 0.0)
    return jnp.broadcast_to(y, (b,) + y.shape[1:]).reshape((b * n_p,) + y.shape[2:])

  kw, vw, law, ww = (window(x) for x in (k, v, log_alpha, write))
  _, states = delta_rule_chunked(
    jnp.zeros_like(kw),
    kw,
    vw,
    law,
    ww,
    start.reshape((b * n_p,) + start.shape[2:]),
    chunk_size=WINDOW_CHUNK,
  )
  return states.reshape(b, n_p, h, kd, vd)
