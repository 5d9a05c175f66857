"""Long-input evaluation: the model run chunk by chunk carrying its decode cache (recurrent state, KV
cache), so inputs far past the training length fit in memory, plus the windows it reads.

``ChunkedScorer(model).score(inputs, targets, chunk)`` gives per-position NLL and argmax-correctness
exactly as one forward over the whole input would (tested), calling ``on_chunk(t_end, cache)`` after each
chunk for state statistics. ``one_shot`` is that single forward (also with ``segment_ids``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.runner import logging_utils


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

    self._prefill = jax.jit(prefill, donate_argnums=(3,))
    self._forward = jax.jit(forward)

  def logits(self, inputs, segment_ids=None) -> jax.Array:
    """One forward from the normal initial state: float32 logits [B, T, vocab]."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return self._forward(self.state, jnp.asarray(inputs, jnp.int32), seg)

  def one_shot(self, inputs, targets, segment_ids=None):
    """(nll [B, T], correct [B, T]) from one forward over the whole input."""
    nll, correct = _token_scores(self.logits(inputs, segment_ids), jnp.asarray(targets, jnp.int32))
    return np.asarray(nll), np.asarray(correct)

  def score(self, inputs, targets, chunk: int, on_chunk=None, progress: str | None = None):
    """(nll [B, T], correct [B, T]) with the input fed ``chunk`` tokens at a time, state carried."""
    inputs, targets = np.asarray(inputs, np.int32), np.asarray(targets, np.int32)
    b, t = inputs.shape
    if chunk <= 0:
      raise ValueError(f'chunk must be positive, got {chunk}')
    cache = self.model.init_cache(b, t)
    nll, correct = np.zeros((b, t), np.float32), np.zeros((b, t), bool)
    bar = logging_utils.Progress(-(-t // chunk), progress) if progress else None
    for s in range(0, t, chunk):
      e = min(s + chunk, t)
      n, c, cache = self._prefill(self.state, jnp.asarray(inputs[:, s:e]), jnp.asarray(targets[:, s:e]),
                                  cache)
      nll[:, s:e], correct[:, s:e] = np.asarray(n), np.asarray(c)
      if on_chunk is not None:
        on_chunk(e, cache)
      if bar:
        bar.update()
    return nll, correct


def document_windows(tokens: np.ndarray, offsets: np.ndarray, length: int, eos_id: int,
                     max_windows: int | None = None) -> tuple[np.ndarray, list[int]]:
  """Non-overlapping windows of ``length + 1`` tokens inside documents, documents in order.

  Each document is read as ``[eos] + doc`` (the separator acts as BOS, as in packed training), so the
  first window of a document starts at its beginning. Returns (windows [N, length + 1], the document
  index of each window); documents shorter than a window contribute none."""
  windows, which = [], []
  for i in range(len(offsets) - 1):
    doc = np.concatenate([[eos_id], np.asarray(tokens[offsets[i]:offsets[i + 1]], np.int64)])
    for s in range(0, len(doc) - length, length):
      windows.append(doc[s:s + length + 1])
      which.append(i)
      if max_windows is not None and len(windows) >= max_windows:
        return np.stack(windows).astype(np.int32), which
  if not windows:
    longest = int(np.max(np.diff(offsets))) if len(offsets) > 1 else 0
    raise ValueError(f'no document holds {length + 1} tokens (the longest has {longest}); use a shorter '
                     'length or longer documents')
  return np.stack(windows).astype(np.int32), which


def position_buckets(length: int, num: int = 64) -> np.ndarray:
  """Bucket edges over positions 0..length: linear for the first 16 positions, then log-spaced."""
  edges = np.unique(np.concatenate([np.arange(min(16, length)),
                                    np.geomspace(16, length, num).round().astype(int) if length > 16 else [],
                                    [length]]).astype(int))
  return edges


def effrem_grid(length: int, points: int) -> np.ndarray:
  """Prefix cut points t in [0, length - 1] (0 included) for Effective Remembrance."""
  return np.unique(np.linspace(0, length - 1, points).round().astype(int))


def effective_remembrance(scorer: ChunkedScorer, sequences: np.ndarray, ts: np.ndarray,
                          batch: int = 16, progress: str | None = None) -> np.ndarray:
  """EffRem_T(t) = TV(q(. | x_{0:T}), q(. | x_{t:T})) for each sequence and each t (docs/math.md section 7).

  ``sequences`` [N, T] are the inputs x_0..x_{T-1}; the prediction compared is the next-token
  distribution after x_{T-1}. The suffix x_{t:T} runs from the normal initial state, written as a second
  segment after the first t tokens (segment_ids), so every row has the same shape [T].
  Returns [N, len(ts)]."""
  n, t_len = sequences.shape
  pos = np.arange(t_len)
  rows = [(i, j, int(t)) for i in range(n) for j, t in enumerate(ts)]
  bar = logging_utils.Progress(-(-len(rows) // batch), progress) if progress else None

  def last_probs(part):
    full = part + [part[-1]] * (batch - len(part))  # one compiled shape
    inputs = np.stack([sequences[r[0]] for r in full])
    seg = np.stack([(pos >= t).astype(np.int32) for *_, t in full])
    probs = jax.nn.softmax(scorer.logits(inputs, seg)[:, -1], axis=-1)
    return np.asarray(probs[:len(part)], np.float64)

  whole = np.concatenate([last_probs([(i, 0, 0) for i in range(s, min(s + batch, n))])
                          for s in range(0, n, batch)])
  out = np.zeros((n, len(ts)), np.float64)
  for s in range(0, len(rows), batch):
    part = rows[s:s + batch]
    probs = last_probs(part)
    for r, (i, j, _) in enumerate(part):
      out[i, j] = 0.5 * np.abs(whole[i] - probs[r]).sum()
    if bar:
      bar.update()
  return out
