"""Token files: 1-D ``.npy`` arrays of token ids (read as memmaps), optionally ``.array_record`` files whose
records are little-endian int32 token sequences (one document per record)."""
from __future__ import annotations

import os

import numpy as np


def load_tokens(path: str) -> np.ndarray:
  if not os.path.exists(path):
    raise FileNotFoundError(f'data file not found: {path!r}')
  if path.endswith('.npy'):
    arr = np.load(path, mmap_mode='r')
    if arr.ndim != 1:
      raise ValueError(f'{path}: expected a 1-D token array, got shape {arr.shape}')
    return arr
  if path.endswith('.array_record'):
    from array_record.python import array_record_module as arm  # pylint: disable=g-import-not-at-top
    reader = arm.ArrayRecordReader(path)
    docs = [np.frombuffer(r, dtype='<i4') for r in reader.read_all()]
    return np.concatenate(docs) if docs else np.zeros((0,), np.int32)
  raise ValueError(f'{path}: unsupported token file type (use .npy or .array_record)')


class WindowSource:
  """Random access to non-overlapping windows of ``seq_len + 1`` tokens."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self.tokens, self.seq_len = tokens, seq_len
    self.n = (len(tokens) - 1) // seq_len
    if self.n <= 0:
      raise ValueError(f'token file has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}')

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    w = np.asarray(self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1], np.int32)
    return {'inputs': w[:-1], 'targets': w[1:], 'mask': np.ones(self.seq_len, np.float32)}


def documents(tokens: np.ndarray, eos_id: int) -> list[tuple[int, int]]:
  """[start, end) spans of documents; each ends with (and includes) ``eos_id``; a trailing rest counts."""
  ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
  starts = np.concatenate([[0], ends[:-1]]) if len(ends) else np.zeros((0,), np.int64)
  spans = [(int(a), int(b)) for a, b in zip(starts, ends) if b - a >= 2]
  last = int(ends[-1]) if len(ends) else 0
  if len(tokens) - last >= 2:
    spans.append((last, len(tokens)))
  return spans


class TBTTSource:
  """Batches for truncated BPTT: ``batch_size`` stable slots, each reading its own documents in order in
  chunks of ``seq_len`` tokens. Element ``n`` is the whole (per-process) batch of step ``n``; a row has
  ``reset=True`` where a new document begins (its state must restart). The last chunk of a document is
  padded (``mask`` 0). Documents are dealt to slots round-robin after a seeded shuffle; an epoch ends when
  the shortest slot stream runs out."""

  def __init__(self, tokens, eos_id, seq_len, global_batch, seed, process_index=0, process_count=1):
    self.tokens, self.seq_len = tokens, seq_len
    docs = documents(tokens, eos_id)
    if len(docs) < global_batch:
      raise ValueError(f'tbtt needs at least global_batch_size={global_batch} documents, found {len(docs)}')
    order = np.random.default_rng(seed).permutation(len(docs))
    local = global_batch // process_count
    slots = range(process_index * local, (process_index + 1) * local)
    streams = []
    for s in slots:
      chunks = []
      for d in order[s::global_batch]:
        a, b = docs[d]
        n = -(-(b - a - 1) // seq_len)
        chunks += [(a + c * seq_len, b, c == 0) for c in range(n)]
      streams.append(chunks)
    self.steps = min(len(c) for c in streams)
    self.streams = [c[:self.steps] for c in streams]

  def __len__(self):
    return self.steps

  def __getitem__(self, n):
    b, t = len(self.streams), self.seq_len
    out = {'inputs': np.zeros((b, t), np.int32), 'targets': np.zeros((b, t), np.int32),
           'mask': np.zeros((b, t), np.float32), 'reset': np.zeros((b,), bool)}
    for r, stream in enumerate(self.streams):
      start, end, first = stream[n]
      w = np.asarray(self.tokens[start:min(start + t + 1, end)], np.int32)
      m = len(w) - 1
      out['inputs'][r, :m] = w[:-1]
      out['targets'][r, :m] = w[1:]
      out['mask'][r, :m] = 1.0
      out['reset'][r] = first
    return out
