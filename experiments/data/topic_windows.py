"""The topic source (experiments/data/topic_source.py) as grain data sources for training.

* :class:`TopicWindows` - index-addressed windows of ``seq_len`` positions cut from a split's documents
  (window ``i`` = window ``i % W`` of document ``i // W``, ``W = doc_len // seq_len``): zero-start
  pretraining, validation, and the carry strategies that take unrelated batches (state_passing), once
  shuffled by the pipeline.
* :class:`TopicTBTTSource` - truncated BPTT: element ``n`` is the whole per-process batch of step
  ``n``; row ``r`` of the global batch reads documents ``r, r + B, r + 2B, ...`` in order, window by window,
  with ``reset=True`` at the first window of each document (its state restarts at BOS). A document's tail
  shorter than a window is not read.
"""
from __future__ import annotations

import numpy as np

from experiments.data import topic_source as ts


class TopicWindows:
  def __init__(self, source: ts.TopicSource, split: int, seq_len: int, num_docs: int, spread: bool = False):
    """``spread``: window ``i`` is window ``(i * 7919) % W`` of document ``i`` instead (validation: the
    first N windows come from N documents at positions spread along them)."""
    self.source, self.split, self.seq_len, self.spread = source, split, seq_len, spread
    self.per_doc = source.windows_per_doc(seq_len)
    if self.per_doc < 1:
      raise ValueError(f'topic source: doc_len={source.params.doc_len} is shorter than a window of '
                       f'seq_len={seq_len}')
    self.num_docs = num_docs
    self.n = num_docs if spread else num_docs * self.per_doc

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    i = int(i)
    if self.spread:
      return self.source.window(self.split, i, (i * 7919) % self.per_doc, self.seq_len)
    return self.source.window(self.split, i // self.per_doc, i % self.per_doc, self.seq_len)


class TopicTBTTSource:
  def __init__(self, source: ts.TopicSource, seq_len: int, global_batch: int, num_docs: int,
               process_index: int = 0, process_count: int = 1, split: int = ts.TRAIN):
    if num_docs < global_batch:
      raise ValueError(f'tbtt needs at least global_batch_size={global_batch} documents, got '
                       f'data.topic.num_train_docs={num_docs}')
    self.source, self.seq_len, self.split, self.global_batch = source, seq_len, split, global_batch
    self.per_doc = source.windows_per_doc(seq_len)
    if self.per_doc < 1:
      raise ValueError(f'topic source: doc_len={source.params.doc_len} is shorter than a window of '
                       f'seq_len={seq_len}')
    local = global_batch // process_count
    self.rows = list(range(process_index * local, (process_index + 1) * local))
    self.steps = (num_docs // global_batch) * self.per_doc

  def __len__(self):
    return self.steps

  def __getitem__(self, n):
    n = int(n)
    j, k = divmod(n, self.per_doc)
    ws = [self.source.window(self.split, r + j * self.global_batch, k, self.seq_len) for r in self.rows]
    out = {key: np.stack([w[key] for w in ws]) for key in ws[0]}
    out['reset'] = np.full((len(self.rows),), k == 0)
    return out
