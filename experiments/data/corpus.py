"""A prepared corpus directory (``python -m experiments.data.prepare --out=<dir>``) as run-config paths.

``config.data.corpus_dir`` names the directory; :func:`resolve` fills the token-file keys it leaves empty
(train_path, eval_path, long_eval_path, eos_id) from the directory's manifest.json and checks that the
model's vocabulary covers the tokenizer's. Explicit paths always win, so one split can be swapped out.
"""

from __future__ import annotations

import json
import os

from experiments import schema

MANIFEST = "manifest.json"
SPLIT_FILES = {"train_path": "train.npy", "eval_path": "val.npy", "long_eval_path": "long_eval.npy"}


def read_manifest(corpus_dir: str) -> dict:
  path = os.path.join(corpus_dir, MANIFEST)
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"config.data.corpus_dir: no {MANIFEST} in {corpus_dir!r}; a corpus prepared with "
      "another --out=<dir> needs --config.data.corpus_dir=<dir> on this command, else build "
      f"it with python -m experiments.data.prepare --out={corpus_dir}"
    )
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def resolve(config) -> dict | None:
  """Fills config.data's token-file keys from ``data.corpus_dir`` (in place); returns the manifest."""
  d = config.data
  if not d.corpus_dir:
    return None
  manifest = read_manifest(d.corpus_dir)
  for key, name in SPLIT_FILES.items():
    if not d[key]:
      d[key] = os.path.join(d.corpus_dir, name)
  if d.eos_id < 0:
    d.eos_id = int(manifest["eos_id"])
  vocab = int(manifest["vocab_size"])
  if int(config.model.vocab_size) < vocab:
    raise schema.ConfigError(
      f"config.model.vocab_size: {config.model.vocab_size} is smaller than the corpus "
      f"tokenizer vocabulary ({vocab}, {d.corpus_dir})"
    )
  return manifest


def tokenizer_path(config) -> str | None:
  """The corpus tokenizer.json, if the run trained on a prepared corpus."""
  if config.data.get("corpus_dir"):
    return os.path.join(config.data.corpus_dir, "tokenizer.json")
  return None
