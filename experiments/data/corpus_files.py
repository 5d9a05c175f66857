"""The files of a prepared corpus: each split's token file and document offsets (``<split>.npy``,
``<split>.docs.npy``), and every file written whole or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np


def atomic_write(path: str, write: Callable) -> None:
  """Writes ``path`` through ``write(binary file)``: a stopped build leaves the previous file."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    write(f)
  os.replace(tmp, path)


def atomic_json(path: str, obj) -> None:
  atomic_write(
    path, lambda f: f.write((json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode())
  )


def save_split(
  out: str, split: str, docs_tokens: Sequence[np.ndarray], eos_id: int
) -> tuple[int, int]:
  """Writes ``<out>/<split>.npy`` (token ids, each document + EOS; uint16 when every id fits, which halves
  the files, else int32) and ``<split>.docs.npy`` (int64 offsets)."""
  lens = np.array([len(t) + 1 for t in docs_tokens], np.int64)
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  top = max([eos_id] + [int(t.max()) for t in docs_tokens if len(t)])
  tokens = np.empty(int(offsets[-1]), np.uint16 if top < 2**16 else np.int32)
  for a, t in zip(offsets[:-1], docs_tokens):
    tokens[a : a + len(t)] = t
    tokens[a + len(t)] = eos_id
  atomic_write(os.path.join(out, f"{split}.npy"), lambda f: np.save(f, tokens))
  atomic_write(os.path.join(out, f"{split}.docs.npy"), lambda f: np.save(f, offsets))
  return len(docs_tokens), len(tokens)


def load_split(out: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, offsets) of a split; document i = tokens[offsets[i]:offsets[i+1]] (ends with EOS)."""
  return (
    np.load(os.path.join(out, f"{split}.npy"), mmap_mode="r"),
    np.load(os.path.join(out, f"{split}.docs.npy")),
  )
