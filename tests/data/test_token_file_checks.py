"""Token files are checked when they are opened (experiments/data/token_files.py): a malformed file, a
sidecar that does not fit, or an id outside the model's vocabulary is one ConfigError line naming the key
and the file, before anything is built, and the loader itself refuses them the same way."""

from __future__ import annotations

import re

import numpy as np
import pytest
from runner_helpers import tiny_config, write_array_record

from experiments import config_checks, schema
from experiments.data import pipeline, token_files

VOCAB, SEQ = 32, 16


def _config(train, eval_path=""):
  c = tiny_config(kind="token_file", train_path=str(train), eval_path=str(eval_path), eos_id=1)
  c.model.vocab_size = VOCAB
  c.data.seq_len = SEQ
  return c


def _docs(n_docs=6, length=20, seed=0):
  """Documents of ids in [2, VOCAB), each ending with eos 1; their offsets."""
  rng = np.random.default_rng(seed)
  docs = [np.append(rng.integers(2, VOCAB, length - 1), 1) for _ in range(n_docs)]
  return np.concatenate(docs).astype(np.int32), np.arange(
    0, n_docs * length + 1, length, dtype=np.int64
  )


def _malformed(tmp_path):
  """(name, what to write, pattern of the message): one per way a token file can be wrong."""
  toks, off = _docs()
  header = tmp_path / "full.npy"
  np.save(header, toks)
  raw = header.read_bytes()
  return [
    ("empty", lambda p: p.write_bytes(b""), r"empty file; expected a \.npy array of token ids"),
    (
      "not_npy",
      lambda p: p.write_bytes(b"hello world, these are not tokens" * 4),
      r"not a readable \.npy array of token ids",
    ),
    (
      "truncated_header",
      lambda p: p.write_bytes(raw[:30]),
      r"not a readable \.npy array of token ids",
    ),
    (
      "truncated_data",
      lambda p: p.write_bytes(raw[: len(raw) - 40]),
      r"not a readable \.npy array of token ids",
    ),
    (
      "two_d",
      lambda p: np.save(p, toks.reshape(2, -1)),
      r"expected a 1-D token array, got shape \(2, 60\)",
    ),
    (
      "floats",
      lambda p: np.save(p, toks.astype(np.float32)),
      r"expected integer token ids, got dtype float32",
    ),
    (
      "short",
      lambda p: np.save(p, toks[:SEQ]),
      rf"{SEQ} tokens, fewer than the {SEQ + 1} of one window",
    ),
    (
      "negative_id",
      lambda p: np.save(p, np.where(np.arange(len(toks)) == 37, -3, toks)),
      rf"token id -3 at position 37 is outside \[0, vocab_size={VOCAB}\)",
    ),
    (
      "id_too_large",
      lambda p: np.save(p, np.where(np.arange(len(toks)) == 50, VOCAB, toks)),
      rf"token id {VOCAB} at position 50 is outside",
    ),
    (
      "sidecar_2d",
      lambda p: (np.save(p, toks), np.save(token_files.docs_path(str(p)), off.reshape(1, -1))),
      r"\.docs\.npy: expected 1-D integer document offsets, got shape \(1, 7\)",
    ),
    (
      "sidecar_garbage",
      lambda p: (np.save(p, toks), open(token_files.docs_path(str(p)), "wb").write(b"xx")),
      r"\.docs\.npy: not a readable \.npy array of document offsets",
    ),
    (
      "sidecar_length",
      lambda p: (np.save(p, toks), np.save(token_files.docs_path(str(p)), off[:-1])),
      rf"expected increasing document offsets from 0 to {len(toks)}",
    ),
    (
      "sidecar_other_file",
      lambda p: (
        np.save(p, toks),
        np.save(token_files.docs_path(str(p)), np.array([0, 25, 60, 120])),
      ),
      r"document 0 ends at token 24 \(id \d+\), not at the separator eos_id=1: these offsets do not belong",
    ),
  ]


def test_malformed_token_files_are_one_line(tmp_path):
  """Each malformed train file: one ConfigError line naming config.data.train_path and the file, from
  the check at start (config_checks.check); the loader (pipeline) refuses it too."""
  cases = _malformed(tmp_path)
  for name, write, pattern in cases:
    path = tmp_path / f"{name}.npy"
    write(path)
    c = _config(path)
    with pytest.raises(schema.ConfigError) as info:
      config_checks.check(c)
    msg = str(info.value)
    # (the file, or its .docs.npy sidecar)
    assert len(msg.splitlines()) == 1 and msg.startswith(
      f"config.data.train_path: {str(path)[:-4]}"
    ), msg
    assert re.search(pattern, msg), (name, msg)
    with pytest.raises(token_files.TokenFileError):
      pipeline.make_eval_batches(_config(path))


def test_ids_are_checked_in_the_eval_file_too(tmp_path):
  """An id past the vocabulary only in the validation file (which trained with loss nan and status
  completed) is named with its key."""
  toks, _ = _docs()
  np.save(tmp_path / "train.npy", toks)
  bad = toks.copy()
  bad[70] = VOCAB + 5
  np.save(tmp_path / "val.npy", bad)
  with pytest.raises(
    schema.ConfigError,
    match=rf"config\.data\.eval_path: .*val\.npy: token id {VOCAB + 5} "
    r"at position 70",
  ):
    config_checks.check(_config(tmp_path / "train.npy", tmp_path / "val.npy"))
  good = _config(tmp_path / "train.npy", tmp_path / "train.npy")
  config_checks.check(good)  # a good pair passes, and loads
  batch = pipeline.make_eval_batches(good)[0]
  assert batch["inputs"].max() < VOCAB and "segment_ids" in batch


def test_array_record_files_are_checked(tmp_path):
  toks, _ = _docs()
  docs = np.split(toks, 6)
  docs[2] = docs[2].copy()
  docs[2][4] = -1
  path = write_array_record(tmp_path / "docs.array_record", docs)
  with pytest.raises(schema.ConfigError, match=r"token id -1 at position 44 is outside"):
    config_checks.check(_config(path))
  (tmp_path / "junk.array_record").write_bytes(b"\x00\x01junk" * 20)
  with pytest.raises(schema.ConfigError, match=r"not a readable \.array_record file"):
    config_checks.check(_config(tmp_path / "junk.array_record"))


def test_an_eos_id_outside_the_vocabulary_blames_the_vocabulary(tmp_path):
  """An eos_id no token can have is named as such before any file is read (not as a sidecar that does
  not fit)."""
  toks, off = _docs()
  path = tmp_path / "train.npy"
  np.save(path, toks)
  np.save(token_files.docs_path(str(path)), off)
  c = _config(path)
  c.data.eos_id = VOCAB + 5
  with pytest.raises(schema.ConfigError, match=r"config.data.eos_id: 37 is outside the model"):
    schema.validate(c)
