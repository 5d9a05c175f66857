"""Token files: 1-D ``.npy`` arrays of token ids (read as memmaps), optionally ``.array_record`` files whose
records are little-endian int32 token sequences (one document per record).

Document boundaries, when known, come from a ``<name>.docs.npy`` sidecar beside ``<name>.npy`` (int64
offsets [n_docs + 1], document i = tokens[off[i]:off[i+1]], as ``experiments.data.prepare`` writes), from
the records of an ``.array_record`` file, or else from a separator token (``eos_id``)."""
from __future__ import annotations

import os

import numpy as np


def docs_path(path: str) -> str:
  """The offsets sidecar of a ``.npy`` token file."""
  return path[:-len('.npy')] + '.docs.npy'


def _array_record_docs(path: str) -> list[np.ndarray]:
  from array_record.python import array_record_module as arm  # pylint: disable=g-import-not-at-top
  reader = arm.ArrayRecordReader(path)
  return [np.frombuffer(r, dtype='<i4') for r in reader.read_all()]


def load_offsets(path: str, tokens: np.ndarray, eos_id: int = -1) -> np.ndarray | None:
  """Document offsets [n_docs + 1] of a token file, or None when its boundaries are unknown."""
  if path.endswith('.npy') and os.path.exists(docs_path(path)):
    off = np.asarray(np.load(docs_path(path)), np.int64)
    if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != len(tokens) or np.any(np.diff(off) <= 0):
      raise ValueError(f'{docs_path(path)}: expected increasing document offsets from 0 to {len(tokens)}')
    return off
  if path.endswith('.array_record'):
    lens = [len(d) for d in _array_record_docs(path)]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  if eos_id >= 0:  # every document ends with (and includes) eos_id; a trailing rest is one more
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    return np.unique(np.concatenate([[0], ends, [len(tokens)]])).astype(np.int64)
  return None


def load_tokens(path: str) -> np.ndarray:
  if not os.path.exists(path):
    raise FileNotFoundError(f'data file not found: {path!r}')
  if path.endswith('.npy'):
    arr = np.load(path, mmap_mode='r')
    if arr.ndim != 1:
      raise ValueError(f'{path}: expected a 1-D token array, got shape {arr.shape}')
    return arr
  if path.endswith('.array_record'):
    docs = _array_record_docs(path)
    return np.concatenate(docs) if docs else np.zeros((0,), np.int32)
  raise ValueError(f'{path}: unsupported token file type (use .npy or .array_record)')


def segment_ids(offsets: np.ndarray, start: int, length: int) -> np.ndarray:
  """Segment id (0, 1, ...) of the inputs ``tokens[start:start + length]`` of a packed window.

  Input position p belongs to the document whose first TARGET is p + 1: document i's inputs are
  ``tokens[off[i] - 1 : off[i+1] - 1]`` (the previous document's last token, its EOS, acts as BOS), so
  every target token of document i is predicted from document i's own context only."""
  p = np.arange(start, start + length) + 1
  doc = np.searchsorted(offsets, p, side='right') - 1
  return (doc - doc[0]).astype(np.int32)


class WindowSource:
  """Random access to non-overlapping windows of ``seq_len + 1`` tokens (packed documents).

  With ``offsets`` (document boundaries) each window also carries ``segment_ids``: the model restarts
  from its initial state wherever a new document begins inside the window."""

  def __init__(self, tokens: np.ndarray, seq_len: int, offsets: np.ndarray | None = None):
    self.tokens, self.seq_len, self.offsets = tokens, seq_len, offsets
    self.n = (len(tokens) - 1) // seq_len
    if self.n <= 0:
      raise ValueError(f'token file has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}')

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    start = i * self.seq_len
    w = np.asarray(self.tokens[start: start + self.seq_len + 1], np.int32)
    out = {'inputs': w[:-1], 'targets': w[1:], 'mask': np.ones(self.seq_len, np.float32)}
    if self.offsets is not None:
      out['segment_ids'] = segment_ids(self.offsets, start, self.seq_len)
    return out


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
