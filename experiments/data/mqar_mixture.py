"""MQAR batches drawn from a mixture of (sequence length, key-value pairs) cells, the Zoology protocol.

Each row picks its cell with the cell's relative weight and is laid out as
:func:`experiments.data.synthetic.mqar_example` lays out one example of that cell (the same distribution:
distinct keys from [1, V/2), values from [V/2, V), every key queried once at power-law gaps after the
context, in a random order); rows shorter than the batch's length are right-padded with token 0 and mask 0.
The models are causal, so the padding after a row's last token changes none of its scored predictions.

One whole batch is generated with array operations (one example at a time costs ~0.1-0.5 ms in numpy,
which at 256 rows x 3 seeds per step would hold a GPU back); every batch is deterministic in
``(seed, index)``.

    cells = ((64, 4, 5.0), (128, 8, 1.0), (256, 64, 1.0))   # (seq_len, pairs, weight)
    b = mqar_mixture.batch(seed=1, index=0, cells=cells, batch_size=256, seq_len=256, vocab_size=8192)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _distinct_keys(
  rng: np.random.Generator, low: int, high: int, counts: np.ndarray, width: int
) -> np.ndarray:
  """[B, width] ints from [low, high), distinct within the first ``counts[r]`` entries of row r.

  Duplicates (after the first occurrence in the row) are redrawn until none is left. The procedure
  treats every value alike, so each row's first ``counts[r]`` keys are uniform over ordered tuples of
  distinct values, as a draw without replacement is."""
  b = len(counts)
  keys = rng.integers(low, high, size=(b, width))
  valid = np.arange(width)[None, :] < counts[:, None]
  while True:
    # unused columns get distinct negative sentinels so they never count as duplicates
    probe = np.where(valid, keys, -1 - np.arange(width)[None, :])
    order = np.argsort(probe, axis=1, kind="stable")
    srt = np.take_along_axis(probe, order, axis=1)
    dup_sorted = np.zeros_like(valid)
    dup_sorted[:, 1:] = srt[:, 1:] == srt[:, :-1]
    dup = np.zeros_like(valid)
    np.put_along_axis(dup, order, dup_sorted, axis=1)
    if not dup.any():
      return keys
    keys[dup] = rng.integers(low, high, size=int(dup.sum()))


def batch(
  seed: int,
  index: int,
  cells: Sequence[tuple],
  batch_size: int,
  seq_len: int,
  vocab_size: int,
  power_a: float = 0.01,
) -> dict:
  """``{'inputs', 'targets': int32 [B, seq_len], 'mask': float32 [B, seq_len], 'cell': int32 [B]}``:
  batch ``index`` of the stream ``seed``; ``cells`` = (length, pairs[, weight]) with length <= seq_len."""
  cells = [(int(c[0]), int(c[1]), float(c[2]) if len(c) > 2 else 1.0) for c in cells]
  lengths = np.array([c[0] for c in cells])
  pairs = np.array([c[1] for c in cells])
  weights = np.array([c[2] for c in cells])
  if np.any(lengths > seq_len) or np.any(4 * pairs > lengths) or not len(cells):
    raise ValueError(f"mqar_mixture: cells {cells} need pairs * 4 <= length <= seq_len={seq_len}")
  rng = np.random.default_rng([int(seed), int(index)])
  which = rng.choice(len(cells), size=batch_size, p=weights / weights.sum())
  t, n = lengths[which], pairs[which]
  width = int(pairs.max())
  cols = np.arange(width)[None, :]
  valid = cols < n[:, None]
  half = vocab_size // 2
  keys = _distinct_keys(rng, 1, half, n, width)
  values = rng.integers(half, vocab_size, size=(batch_size, width))
  # Query slots: even offsets after the context; n of the row's `space` slots without replacement, with
  # probability decreasing as a power of the gap (Gumbel top-k = sequential weighted draws).
  space = (t + 1 - 2 * n) // 2
  # (at least `width` slots: a batch whose rows all have fewer than `width` pairs still picks
  # `width` columns; the slots past a row's space score -inf and are never valid)
  slots = np.arange(max(int(space.max()), width))[None, :]
  logw = (-1.0 + power_a) * np.log(slots + 1.0) if power_a else np.zeros(slots.shape)
  score = np.where(
    slots < space[:, None],
    logw - np.log(-np.log(rng.random((batch_size, slots.shape[1])))),
    -np.inf,
  )
  chosen = np.argsort(-score, axis=1, kind="stable")[:, :width]
  chosen = np.sort(
    np.where(valid, chosen, np.iinfo(np.int64).max), axis=1
  )  # the row's n slots, in order
  order = np.argsort(
    np.where(valid, rng.random((batch_size, width)), np.inf), axis=1
  )  # query order
  rows = np.arange(batch_size)[:, None]
  dump = seq_len + 1  # invalid columns write here, outside the sequence
  seq = np.zeros((batch_size, seq_len + 2), np.int64)
  seq[rows, np.where(valid, 2 * cols, dump)] = keys
  seq[rows, np.where(valid, 2 * cols + 1, dump)] = values
  qpos = np.where(valid, 2 * n[:, None] + 2 * np.where(valid, chosen, 0), dump)
  seq[rows, qpos] = np.take_along_axis(keys, order, axis=1)
  seq[rows, np.where(valid, qpos + 1, dump)] = np.take_along_axis(values, order, axis=1)
  mask = np.zeros((batch_size, seq_len + 2), np.float32)
  mask[rows, qpos] = 1.0
  return {
    "inputs": seq[:, :seq_len].astype(np.int32),
    "targets": seq[:, 1 : seq_len + 1].astype(np.int32),
    "mask": mask[:, :seq_len],
    "cell": which.astype(np.int32),
  }
