"""Byte-level BPE tokenizer (HF ``tokenizers``), trained on a corpus's train split and saved beside it.

    tok = BPETokenizer.train(texts, vocab_size=16384)   # texts: an iterable of documents (str)
    tok.save(corpus_dir)                                # writes <corpus_dir>/tokenizer.json
    tok = BPETokenizer.load(corpus_dir)                 # a directory or a tokenizer.json path
    ids = tok.encode('text')                            # int32 [n]; no special tokens added
    tok.decode(ids) == 'text'                           # byte-level: every string round-trips

The only special token is ``<|endoftext|>`` (id 0, ``eos_id``): the corpus ends every document with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

EOS = "<|endoftext|>"
FILENAME = "tokenizer.json"


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # an optional dependency of the corpus path only
    raise ImportError("the corpus tokenizer needs HF tokenizers: pip install tokenizers") from e
  return tokenizers


class BPETokenizer:
  def __init__(self, tok):
    self._tok = tok
    self.eos_id = tok.token_to_id(EOS)
    if self.eos_id is None:
      raise ValueError(f"tokenizer has no {EOS} token")

  @classmethod
  def train(
    cls, texts: Iterable[str], vocab_size: int = 16384, min_frequency: int = 2
  ) -> BPETokenizer:
    t = _tokenizers()
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=[EOS],
      initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return cls(tok)

  @classmethod
  def load(cls, path: str) -> BPETokenizer:
    """``path``: a corpus directory holding tokenizer.json, or the json file itself."""
    file = os.path.join(path, FILENAME) if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise FileNotFoundError(
        f"tokenizer not found: {file!r} (build the corpus with python -m experiments.data.prepare)"
      )
    try:
      tok = _tokenizers().Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-except  (truncated or not a tokenizer: Rust's error)
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      raise ValueError(f"tokenizer: {file!r} is not a readable tokenizer.json ({first})") from None
    return cls(tok)

  @classmethod
  def from_str(cls, tokenizer_json: str) -> BPETokenizer:
    return cls(_tokenizers().Tokenizer.from_str(tokenizer_json))

  def to_str(self) -> str:
    """The tokenizer.json text (what a worker process is built from)."""
    return self._tok.to_str()

  def save(self, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    file = os.path.join(directory, FILENAME)
    tmp = file + ".tmp"
    self._tok.save(tmp)
    os.replace(tmp, file)
    return file

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [
      np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)
    ]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
