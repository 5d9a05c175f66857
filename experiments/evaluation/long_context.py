"""Long-input evaluation: the model run chunk by chunk carrying its decode cache (recurrent state, KV
cache), so inputs far past the training length fit in memory, plus the windows it reads.

``ChunkedScorer(model).score(inputs, targets, chunk)`` gives per-position NLL and argmax-correctness
exactly as one forward over the whole input would (tested), calling ``on_chunk(t_end, cache)`` after each
chunk for state statistics. ``one_shot`` is that single forward (also with ``segment_ids``).
``state_series`` calls the same ``on_chunk`` without scoring: the states at chunk ends read from forwards
of several chunks at once (the model's prefix_states; no logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.runner import logging_utils
from kdn_jax.models.generate import cache_at

# Tokens per forward of ChunkedScorer.state_series (a multiple of its chunk): activations of one
# forward-only pass over this many tokens per row, far below a training step's.
STATE_PIECE_TOKENS = 8192


def _token_scores(logits, targets):
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
  return nll, jnp.argmax(logits, axis=-1) == targets


class ChunkedScorer:
  """Jitted forward passes of one model (its parameters split once)."""

  def __init__(self, model):
    self.model = model
    self.graphdef, self.state = nnx.split(model)

    def prefill(state, inputs, targets, cache):
      logits, cache = nnx.merge(self.graphdef, state).prefill(inputs, cache)
      nll, correct = _token_scores(logits, targets)
      return nll, correct, cache

    def forward(state, inputs, segment_ids):
      logits, _ = nnx.merge(self.graphdef, state)(inputs, segment_ids=segment_ids)
      return logits.astype(jnp.float32)

    def forward_at(state, inputs, segment_ids, read_positions):
      logits, _ = nnx.merge(self.graphdef, state)(
        inputs, segment_ids=segment_ids, read_positions=read_positions
      )
      return logits.astype(jnp.float32)

    def states_at(state, inputs, cache, positions):
      return nnx.merge(self.graphdef, state).prefix_states(
        inputs, np.asarray(positions), states=cache
      )[1]

    self._prefill = jax.jit(prefill, donate_argnums=(3,))
    self._forward = jax.jit(forward)
    self._forward_at = jax.jit(forward_at)
    self._states_at = jax.jit(states_at, static_argnums=(3,))

  def logits(self, inputs, segment_ids=None) -> jax.Array:
    """One forward from the normal initial state: float32 logits [B, T, vocab]."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return self._forward(self.state, jnp.asarray(inputs, jnp.int32), seg)

  def logits_at(self, inputs, segment_ids, read_positions) -> jax.Array:
    """float32 logits [B, P, vocab] at read_positions [B, P] of one forward (the head only there)."""
    return self._forward_at(
      self.state,
      jnp.asarray(inputs, jnp.int32),
      jnp.asarray(segment_ids, jnp.int32),
      jnp.asarray(read_positions, jnp.int32),
    )

  def state_series(self, inputs, chunk: int, on_chunk, progress: str | None = None) -> None:
    """``on_chunk(t_end, cache)`` after every ``chunk`` tokens and at the end, as ``score`` calls it,
    without scoring (``states_at`` at the chunk ends). Recurrent-only models."""
    t = np.shape(inputs)[1]
    if chunk <= 0:
      raise ValueError(f"chunk must be positive, got {chunk}")
    self.states_at(inputs, list(range(chunk, t, chunk)) + [t], on_chunk, progress)

  def states_at(self, inputs, ends, on_state, progress: str | None = None) -> None:
    """``on_state(t_end, cache)`` at each of ``ends`` (token counts, increasing, the last at most the
    input's length): the states read inside forwards of up to STATE_PIECE_TOKENS tokens (or to the
    next end, when further; prefix_states, the ops' output_states_at), no logits, the state carried
    from one forward to the next. Recurrent-only models."""
    inputs = np.asarray(inputs, np.int32)
    ends = [int(t) for t in ends]
    if not ends or ends != sorted(set(ends)) or ends[0] < 1 or ends[-1] > inputs.shape[1]:
      raise ValueError(
        f"ends: expected increasing token counts in [1, {inputs.shape[1]}], got {ends[:8]}"
      )
    groups, i, s = [], 0, 0
    while i < len(ends):
      limit = max(s + STATE_PIECE_TOKENS, ends[i])
      group = [t for t in ends[i:] if t <= limit]
      groups.append((s, group))
      s, i = group[-1], i + len(group)
    cache = None
    bar = logging_utils.Progress(len(groups), progress) if progress else None
    for s, group in groups:
      caches = self._states_at(
        self.state, jnp.asarray(inputs[:, s : group[-1]]), cache, tuple(t - s for t in group)
      )
      for k, t_end in enumerate(group):
        on_state(t_end, cache_at(caches, k))
      cache = cache_at(caches, len(group) - 1)
      if bar:
        bar.update()

  def one_shot(self, inputs, targets, segment_ids=None):
    """(nll [B, T], correct [B, T]) from one forward over the whole input."""
    nll, correct = _token_scores(self.logits(inputs, segment_ids), jnp.asarray(targets, jnp.int32))
    return np.asarray(nll), np.asarray(correct)

  def score(self, inputs, targets, chunk: int, on_chunk=None, progress: str | None = None):
    """(nll [B, T], correct [B, T]) with the input fed ``chunk`` tokens at a time, state carried."""
    inputs, targets = np.asarray(inputs, np.int32), np.asarray(targets, np.int32)
    b, t = inputs.shape
    if chunk <= 0:
      raise ValueError(f"chunk must be positive, got {chunk}")
    cache = self.model.init_cache(b, t)
    nll, correct = np.zeros((b, t), np.float32), np.zeros((b, t), bool)
    bar = logging_utils.Progress(-(-t // chunk), progress) if progress else None
    for s in range(0, t, chunk):
      e = min(s + chunk, t)
      n, c, cache = self._prefill(
        self.state, jnp.asarray(inputs[:, s:e]), jnp.asarray(targets[:, s:e]), cache
      )
      nll[:, s:e], correct[:, s:e] = np.asarray(n), np.asarray(c)
      if on_chunk is not None:
        on_chunk(e, cache)
      if bar:
        bar.update()
    return nll, correct


def document_windows(
  tokens: np.ndarray, offsets: np.ndarray, length: int, eos_id: int, max_windows: int | None = None
) -> tuple[np.ndarray, list[int]]:
  """Non-overlapping windows of ``length + 1`` tokens inside documents, documents in order.

  Each document is read as ``[eos] + doc`` (the separator acts as BOS, as in packed training), so the
  first window of a document starts at its beginning. Returns (windows [N, length + 1], the document
  index of each window); documents shorter than a window contribute none."""
  windows, which = [], []
  for i in range(len(offsets) - 1):
    doc = np.concatenate([[eos_id], np.asarray(tokens[offsets[i] : offsets[i + 1]], np.int64)])
    for s in range(0, len(doc) - length, length):
      windows.append(doc[s : s + length + 1])
      which.append(i)
      if max_windows is not None and len(windows) >= max_windows:
        return np.stack(windows).astype(np.int32), which
  if not windows:
    longest = int(np.max(np.diff(offsets))) if len(offsets) > 1 else 0
    raise ValueError(
      f"no document holds {length + 1} tokens (the longest has {longest}); use a shorter "
      "length or longer documents"
    )
  return np.stack(windows).astype(np.int32), which


def spread_windows(
  tokens: np.ndarray, offsets: np.ndarray, length: int, eos_id: int, n: int, seed: int = 0
) -> tuple[np.ndarray, list[int]]:
  """Up to ``n`` windows of ``length + 1`` tokens spread over the documents: each document long
  enough gives its first window (read as ``[eos] + doc``, so it starts at the document's start), the
  documents in an order drawn from ``seed``; only when there are fewer such documents than ``n`` do
  they give further windows, round by round. Windows are the bootstrap units of the long
  evaluation, so one document (one topic, one style) must not fill the sample as the first N in
  file order would. Returns (windows [N', length + 1], the document index of each)."""
  lengths = np.diff(np.asarray(offsets, np.int64)) + 1  # with the leading separator
  per_doc = np.maximum((lengths - 1) // length, 0)  # windows each document holds
  docs = np.flatnonzero(per_doc > 0)
  if not len(docs):
    longest = int(lengths.max() - 1) if len(lengths) else 0
    raise ValueError(
      f"no document holds {length + 1} tokens (the longest has {longest}); use a shorter "
      "length or longer documents"
    )
  docs = np.random.default_rng(seed).permutation(docs)
  picks = []
  for r in range(int(per_doc.max())):
    picks += [(int(i), r) for i in docs if per_doc[i] > r]
    if len(picks) >= n:
      break
  windows = []
  for i, r in picks[:n]:
    doc = np.concatenate([[eos_id], np.asarray(tokens[offsets[i] : offsets[i + 1]], np.int64)])
    windows.append(doc[r * length : r * length + length + 1])
  return np.stack(windows).astype(np.int32), [i for i, _ in picks[:n]]


def position_buckets(length: int, num: int = 64) -> np.ndarray:
  """Bucket edges over positions 0..length: linear for the first 16 positions, then log-spaced."""
  edges = np.unique(
    np.concatenate(
      [
        np.arange(min(16, length)),
        np.geomspace(16, length, num).round().astype(int) if length > 16 else [],
        [length],
      ]
    ).astype(int)
  )
  return edges


def effrem_grid(length: int, points: int) -> np.ndarray:
  """Prefix cut points t in [0, length - 1] (0 included) for Effective Remembrance."""
  return np.unique(np.linspace(0, length - 1, points).round().astype(int))


def _pack_suffixes(n: int, t_len: int, ts) -> list[list[tuple[int, int, int]]]:
  """The suffixes x_{t:T} of every (sequence i, cut j at t) packed first-fit decreasing into rows of
  t_len tokens: a list of rows, each a list of (i, j, t)."""
  items = sorted(
    ((t_len - int(t), i, j, int(t)) for i in range(n) for j, t in enumerate(ts)),
    key=lambda x: (-x[0], x[1], x[2]),
  )
  rows, free = [], []
  for length, i, j, t in items:
    for r, f in enumerate(free):
      if f >= length:
        rows[r].append((i, j, t))
        free[r] -= length
        break
    else:
      rows.append([(i, j, t)])
      free.append(t_len - length)
  return rows


def effective_remembrance(
  scorer: ChunkedScorer,
  sequences: np.ndarray,
  ts: np.ndarray,
  batch: int = 16,
  progress: str | None = None,
) -> np.ndarray:
  """EffRem_T(t) = TV(q(. | x_{0:T}), q(. | x_{t:T})) for each sequence and each t (docs/math.md section 7).

  ``sequences`` [N, T] are the inputs x_0..x_{T-1}; the prediction compared is the next-token
  distribution after x_{T-1}. Every suffix x_{t:T} runs from the normal initial state as its own
  segment, the suffixes packed side by side into rows of T tokens (the whole sequence is the t = 0
  suffix), with the head read only at each suffix's last token: about half the tokens of one row per cut
  (a packed segment runs exactly as alone: segment_ids). Returns [N, len(ts)]."""
  n, t_len = sequences.shape
  cuts = np.asarray(ts, np.int64)
  if not np.any(cuts == 0):  # the whole-sequence prediction rides along as the t = 0 suffix
    cuts = np.concatenate([[0], cuts])
  rows = _pack_suffixes(n, t_len, cuts)
  per_row = max(len(r) for r in rows)
  bar = logging_utils.Progress(-(-len(rows) // batch), progress) if progress else None
  probs = {}
  for s in range(0, len(rows), batch):
    part = rows[s : s + batch]
    part = part + [part[-1]] * (batch - len(part))  # one compiled shape
    inputs = np.zeros((batch, t_len), np.int32)
    seg = np.zeros((batch, t_len), np.int32)
    read = np.zeros((batch, per_row), np.int32)
    for r, row in enumerate(part):
      at = 0
      for k, (i, _, t) in enumerate(row):
        inputs[r, at : at + t_len - t] = sequences[i, t:]
        seg[r, at : at + t_len - t] = k
        at += t_len - t
        read[r, k] = at - 1
      seg[r, at:] = len(row)  # the unused tail: a segment of its own
      read[r, len(row) :] = read[r, len(row) - 1]
    p = np.asarray(jax.nn.softmax(scorer.logits_at(inputs, seg, read), axis=-1), np.float64)
    for r, row in enumerate(part[: len(rows[s : s + batch])]):
      for k, (i, _, t) in enumerate(row):
        probs[i, t] = p[r, k]
    if bar:
      bar.update()
  out = np.zeros((n, len(ts)), np.float64)
  for i in range(n):
    for j, t in enumerate(ts):
      out[i, j] = 0.5 * np.abs(probs[i, 0] - probs[i, int(t)]).sum()
  return out
