"""Writes a synthetic 1-D token file (.npy) of documents for trying the token-file LM path on CPU.

    python -m experiments.data.make_token_file /tmp/kdn_tokens.npy --num_docs=2000 --vocab=256

Each document is a noisy repetition of a short random pattern, ends with ``eos`` (token 1), so models can
learn in-context copying and tbtt has document boundaries.
"""

from __future__ import annotations

import argparse

import numpy as np


def make_docs(num_docs, vocab, seed=0, min_len=64, max_len=1024, eos=1):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num_docs):
    n = int(rng.integers(min_len, max_len))
    pat = rng.integers(2, vocab, size=int(rng.integers(4, 32)))
    doc = np.resize(pat, n)
    noise = rng.random(n) < 0.1
    doc[noise] = rng.integers(2, vocab, size=int(noise.sum()))
    out.append(np.append(doc, eos))
  return np.concatenate(out).astype(np.int32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("path")
  p.add_argument("--num_docs", type=int, default=2000)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  toks = make_docs(a.num_docs, a.vocab, a.seed)
  np.save(a.path, toks)
  print(f"wrote {len(toks)} tokens to {a.path}")


if __name__ == "__main__":
  main()
