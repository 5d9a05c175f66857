"""The topic source (experiments/data/topic_source.py) as grain data sources for training.

Window ``i`` of a split is window ``i % W`` of document ``i // W`` (``W = doc_len // seq_len``; a
document's tail shorter than a window is not read).

* :class:`TopicWindows` - index-addressed windows: validation batches, and (``spread``) one window
  per document at positions spread along the documents.
* :class:`WindowBatch` - a batch of window indices -> the batch, generated in one vectorised pass:
  the pipeline shuffles and batches indices, then maps this (zero-start pretraining, noise
  strategies and state_passing, whose carried state comes from the previous, unrelated batch).
* :class:`TopicTBTTSource` - truncated BPTT: element ``n`` is the whole per-process batch of step
  ``n``; row ``r`` of the global batch reads documents ``r, r + B, r + 2B, ...`` in order, window by
  window, with ``reset=True`` at the first window of each document (its state restarts at BOS).
"""

from __future__ import annotations

import numpy as np

from experiments.data import topic_source as ts

SPREAD = 7919  # a prime: window (i * SPREAD) % W of document i spreads the validation positions


def _per_doc(source: ts.TopicSource, seq_len: int) -> int:
  w = source.windows_per_doc(seq_len)
  if w < 1:
    raise ValueError(
      f"topic source: doc_len={source.params.doc_len} is shorter than a window of seq_len={seq_len}"
    )
  return w


class TopicWindows:
  def __init__(
    self, source: ts.TopicSource, split: int, seq_len: int, num_docs: int, spread: bool = False
  ):
    self.source, self.split, self.seq_len, self.spread = source, split, seq_len, spread
    self.per_doc = _per_doc(source, seq_len)
    self.n = num_docs if spread else num_docs * self.per_doc

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    i = int(i)
    if self.spread:
      return self.source.window(self.split, i, (i * SPREAD) % self.per_doc, self.seq_len)
    return self.source.window(self.split, i // self.per_doc, i % self.per_doc, self.seq_len)


class WindowBatch:
  """Maps an int array of window indices to the batch of those windows."""

  def __init__(self, source: ts.TopicSource, split: int, seq_len: int):
    self.source, self.split, self.seq_len = source, split, seq_len
    self.per_doc = _per_doc(source, seq_len)

  def __call__(self, indices) -> dict:
    docs, ks = np.divmod(np.asarray(indices, np.int64), self.per_doc)
    return self.source.windows(self.split, docs, ks, self.seq_len)


class TopicTBTTSource:
  def __init__(
    self,
    source: ts.TopicSource,
    seq_len: int,
    global_batch: int,
    num_docs: int,
    process_index: int = 0,
    process_count: int = 1,
    split: int = ts.TRAIN,
  ):
    if num_docs < global_batch:
      raise ValueError(
        f"tbtt needs at least global_batch_size={global_batch} documents, got "
        f"data.topic.num_train_docs={num_docs}"
      )
    self.source, self.seq_len, self.split, self.global_batch = source, seq_len, split, global_batch
    self.per_doc = _per_doc(source, seq_len)
    local = global_batch // process_count
    self.rows = np.arange(process_index * local, (process_index + 1) * local, dtype=np.int64)
    self.steps = (num_docs // global_batch) * self.per_doc

  def __len__(self):
    return self.steps

  def __getitem__(self, n):
    j, k = divmod(int(n), self.per_doc)
    out = self.source.windows(
      self.split, self.rows + j * self.global_batch, np.full(len(self.rows), k), self.seq_len
    )
    out["reset"] = np.full((len(self.rows),), k == 0)
    return out
