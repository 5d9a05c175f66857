"""Truncated BPTT over passkey documents longer than the training length.

A TBTT document is one passkey example of ``n * seq_len`` tokens (``n`` drawn uniformly from 1 ..
``max_chunks`` per document), read in ``n`` consecutive chunks of ``seq_len`` by one batch slot
with the state carried between them (``reset`` marks a document's first chunk). Only the answer
digits are scored, so a document's loss sits in its last chunk: the earlier chunks teach nothing
directly but hand that chunk a state written over up to ``n * seq_len`` tokens, which is the state
distribution a longer readout meets.
"""

from __future__ import annotations

import numpy as np

from experiments.data import synthetic


class PasskeyTBTTSource:
  """Element ``n`` is the whole (per-process) batch of step ``n``: ``inputs``, ``targets``,
  ``mask`` [B, T] and ``reset`` [B]. Deterministic from ``seed``; slots are independent streams."""

  def __init__(
    self,
    *,
    seq_len,
    global_batch,
    steps,
    seed,
    vocab_size,
    digits,
    max_chunks=4,
    process_index=0,
    process_count=1,
  ):
    if max_chunks < 1:
      raise ValueError(f"data.passkey.tbtt_chunks: must be >= 1, got {max_chunks}")
    self.seq_len, self.seed, self.steps = seq_len, seed, steps
    self.vocab_size, self.digits = vocab_size, digits
    local = global_batch // process_count
    self.slots = []
    for s in range(process_index * local, (process_index + 1) * local):
      rng = np.random.default_rng([seed, s])
      chunks, doc = [], 0
      while len(chunks) < steps:
        n = int(rng.integers(1, max_chunks + 1))
        # the document's example index: unique over (slot, document)
        chunks += [(doc * global_batch + s, n, c) for c in range(n)]
        doc += 1
      self.slots.append(chunks[:steps])

  def __len__(self):
    return self.steps

  def document(self, index, n):
    return synthetic.passkey_example(
      index,
      seed=self.seed,
      seq_len=n * self.seq_len,
      vocab_size=self.vocab_size,
      digits=self.digits,
    )

  def __getitem__(self, step):
    t = self.seq_len
    rows = []
    for chunks in self.slots:
      index, n, c = chunks[step]
      doc = self.document(index, n)
      rows.append(
        {k: doc[k][c * t : (c + 1) * t] for k in ("inputs", "targets", "mask")} | {"reset": c == 0}
      )
    return {
      k: np.stack([np.asarray(r[k]) for r in rows]).astype(
        {"inputs": np.int32, "targets": np.int32, "mask": np.float32, "reset": bool}[k]
      )
      for k in ("inputs", "targets", "mask", "reset")
    }
