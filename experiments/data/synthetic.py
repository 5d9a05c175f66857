"""Synthetic tasks as index-addressed example generators (deterministic in (seed, index)).

Each generator returns ``{'inputs': int32[T], 'targets': int32[T], 'mask': float32[T]}``: targets are inputs
shifted by one and ``mask`` marks the positions that are scored (loss and accuracy).
"""

from __future__ import annotations

import numpy as np


def _rng(seed: int, index: int) -> np.random.Generator:
  return np.random.default_rng([int(seed), int(index)])


def _pack(seq: np.ndarray, scored: np.ndarray, seq_len: int) -> dict:
  """``seq``: full token sequence (length seq_len + 1); ``scored``: positions t whose target seq[t+1] counts."""
  mask = np.zeros(seq_len, np.float32)
  mask[scored] = 1.0
  return {
    "inputs": seq[:seq_len].astype(np.int32),
    "targets": seq[1 : seq_len + 1].astype(np.int32),
    "mask": mask,
  }


def mqar_example(
  index: int, *, seed: int, seq_len: int, vocab_size: int, num_kv_pairs: int, power_a: float = 0.01
) -> dict:
  """Multi-query associative recall (Zoology-style).

  ``k1 v1 k2 v2 ... kN vN`` followed by filler (0) in which every key is queried once at a random position
  (query gaps drawn from a power law, as in Zoology); the target after a query key is its value. Keys come
  from [1, V/2), values from [V/2, V). Chance accuracy is 2/V (or 1/N guessing among the seen values).
  """
  rng = _rng(seed, index)
  n = num_kv_pairs
  half = vocab_size // 2
  keys = rng.choice(np.arange(1, half), size=n, replace=False)
  values = rng.choice(np.arange(half, vocab_size), size=n, replace=True)
  seq = np.zeros(seq_len + 1, np.int64)
  seq[0 : 2 * n : 2] = keys
  seq[1 : 2 * n : 2] = values
  # Query slots: even offsets after the context, so a query key and its value never overlap.
  space = (seq_len + 1 - 2 * n) // 2
  slots = np.arange(space)
  p = (slots + 1.0) ** (-1.0 + power_a) if power_a else np.ones(space)
  # Zoology samples query positions with power-law decreasing probability in the gap.
  p = p / p.sum()
  chosen = np.sort(rng.choice(slots, size=n, replace=False, p=p))
  order = rng.permutation(n)
  qpos = 2 * n + 2 * chosen
  seq[qpos] = keys[order]
  seq[qpos + 1] = values[order]
  return _pack(seq, qpos, seq_len)


def copying_example(
  index: int, *, seed: int, seq_len: int, vocab_size: int, copy_len: int, min_copy_len: int = 0
) -> dict:
  """``BOS x_1..x_L SEP x_1..x_L`` then padding; the copied half is scored. Tokens 0/1/2 = pad/BOS/SEP.

  ``min_copy_len`` (optional): 0 (default) or ``copy_len`` = every example copies exactly ``copy_len``
  symbols (the same draws as before the option existed); ``1 <= min_copy_len < copy_len`` = the example's
  length L is drawn uniformly from ``[min_copy_len, copy_len]`` (first draw of the example's generator, so
  still deterministic in (seed, index)); ``seq_len`` must hold the longest, ``2 * copy_len + 1``.
  """
  rng = _rng(seed, index)
  if min_copy_len and min_copy_len != copy_len:
    if not 1 <= min_copy_len < copy_len:
      raise ValueError(
        f"copying: min_copy_len must be 0 or in [1, copy_len={copy_len}], got {min_copy_len}"
      )
    copy_len = int(rng.integers(min_copy_len, copy_len + 1))
  if 2 * copy_len + 1 > seq_len:
    raise ValueError(
      f"copying: seq_len={seq_len} is too short for copy_len={copy_len} "
      f"(needs seq_len >= {2 * copy_len + 1})"
    )
  x = rng.integers(3, vocab_size, size=copy_len)
  seq = np.zeros(seq_len + 1, np.int64)
  seq[0] = 1
  seq[1 : 1 + copy_len] = x
  seq[1 + copy_len] = 2
  seq[2 + copy_len : 2 + 2 * copy_len] = x
  scored = np.arange(1 + copy_len, 1 + 2 * copy_len)
  return _pack(seq, scored, seq_len)


def passkey_example(
  index: int, *, seed: int, seq_len: int, vocab_size: int, digits: int, depth: float | None = None
) -> dict:
  """Filler tokens with ``KEY d_1..d_D`` hidden at a random depth and ``QUERY d_1..d_D`` at the end; the
  answer digits are scored. Tokens: 1 = KEY, 2 = QUERY, 10..19 = digits, 20.. = filler.

  ``depth`` (optional, a fraction in [0, 1]) fixes where KEY sits: position
  ``round(depth * (seq_len - 2 * digits - 2))``, 0 = the first token, 1 = the last slot that leaves one filler
  token before QUERY. ``None`` (default) draws it uniformly (the same draws as before ``depth`` existed).
  """
  rng = _rng(seed, index)
  code = rng.integers(0, 10, size=digits) + 10
  seq = rng.integers(20, vocab_size, size=seq_len + 1)
  q = seq_len - digits  # QUERY position; the digits follow up to the end
  if q - digits - 1 < 1:
    raise ValueError(
      f"passkey: seq_len={seq_len} is too short for digits={digits} "
      f"(needs seq_len >= {2 * digits + 2})"
    )
  if depth is None:
    pos = rng.integers(0, q - digits - 1)
  else:
    if not 0.0 <= depth <= 1.0:
      raise ValueError(f"passkey: depth must be in [0, 1], got {depth}")
    pos = int(round(depth * (q - digits - 2)))
  seq[pos] = 1
  seq[pos + 1 : pos + 1 + digits] = code
  seq[q] = 2
  seq[q + 1 : q + 1 + digits] = code
  return _pack(seq, np.arange(q, q + digits), seq_len)
