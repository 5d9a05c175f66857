"""A corpus's documents tokenized in batches, on a pool of processes, with progress lines."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence

import numpy as np

from experiments.data import corpus_fetch
from experiments.data.tokenizer import BPETokenizer


class _Progress:
  def __init__(self, what: str, total_bytes: int, log, every_s: float = 5.0):
    self.what, self.total, self.log, self.every = what, max(total_bytes, 1), log, every_s
    self.t0 = self.last = time.time()

  def update(self, done_bytes: int, tokens: int, final: bool = False):
    now = time.time()
    if not final and now - self.last < self.every:
      return
    self.last = now
    dt = max(now - self.t0, 1e-9)
    rate = done_bytes / dt
    eta = (self.total - done_bytes) / rate if rate > 0 else 0.0
    self.log(
      f"prepare: {self.what}: {done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB, {tokens / 1e6:.2f}M tokens, "
      f"{rate / 1e6:.2f} MB/s, " + (f"{dt:.1f} s" if final else f"ETA {eta:.0f} s")
    )


_WORKER_TOK = None


def _worker_init(tok_json: str) -> None:
  global _WORKER_TOK
  os.environ["TOKENIZERS_PARALLELISM"] = (
    "false"  # one core per process: the pool is the parallelism
  )
  _WORKER_TOK = BPETokenizer.from_str(tok_json)


def _compact(ids: list[np.ndarray], vocab_size: int) -> list[np.ndarray]:
  # uint16 halves what travels back from the workers and what a 1 GB corpus holds in memory
  return [e.astype(np.uint16) for e in ids] if vocab_size <= 2**16 else ids


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
  return _compact(_WORKER_TOK.encode_batch(texts), _WORKER_TOK.vocab_size)


def _batches(sizes: Sequence[int], batch_bytes: int) -> list[tuple[int, int]]:
  out, i = [], 0
  while i < len(sizes):
    j, b = i, 0
    while j < len(sizes) and (j == i or b + sizes[j] <= batch_bytes):
      b += sizes[j]
      j += 1
    out.append((i, j))
    i = j
  return out


def tokenize_documents(
  tok: BPETokenizer,
  texts: Sequence[str],
  what: str,
  log=print,
  batch_bytes: int = 4_000_000,
  workers: int | None = None,
) -> list[np.ndarray]:
  """Token ids of every text, in order: ``encode_batch`` over batches of ~``batch_bytes`` of text, with
  progress lines (MB/s, ETA). With ``workers`` > 1 (default: every core this process may use) and
  more than one batch, the batches go to a process pool: encoding and the ids' conversion to arrays
  then run on every core (in one process the conversion holds the GIL)."""
  sizes = [len(t.encode("utf-8")) for t in texts]
  prog = _Progress(what, sum(sizes), log)
  spans = _batches(sizes, batch_bytes)
  workers = min(corpus_fetch.cpu_workers() if workers is None else workers, len(spans))
  out, done, ntok = [], 0, 0
  if workers > 1:
    ctx = multiprocessing.get_context(
      "spawn"
    )  # (fork would copy a process whose XLA threads may hold locks)
    with ctx.Pool(workers, _worker_init, (tok.to_str(),)) as pool:
      encoded = pool.imap(_worker_encode, (list(texts[i:j]) for i, j in spans))
      for (i, j), enc in zip(spans, encoded):
        out += enc
        done += sum(sizes[i:j])
        ntok += sum(len(e) for e in enc)
        prog.update(done, ntok)
  else:
    for i, j in spans:
      enc = _compact(tok.encode_batch(list(texts[i:j])), tok.vocab_size)
      out += enc
      done += sum(sizes[i:j])
      ntok += sum(len(e) for e in enc)
      prog.update(done, ntok)
  prog.update(done, ntok, final=True)
  return out
