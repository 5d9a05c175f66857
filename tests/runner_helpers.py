"""Shared helpers for the runner and evaluation tests: tiny real-model run configs, token-file and corpus
fixtures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

from experiments import schema
from experiments.data import corpus
from experiments.data.tokenizer import BPETokenizer
from kdn_jax.models.config import model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device_env():
  """os.environ for a child process that runs jax on one CPU device: the suite's XLA flags
  (tests/conftest.py) without the simulated devices, and the repository on PYTHONPATH."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  return dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags.strip())


def run_one_device(args, timeout: float = 600) -> subprocess.CompletedProcess:
  """``python <args>`` in a child process on one CPU device, from the repository root; its stdout and
  stderr captured as text."""
  return subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    env=one_device_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def tiny_config(initial_state="zero", layer_pattern="kdn_diag,attention", **data_overrides):
  c = schema.base_config()
  c.seed = 0
  c.model = model_config(
    "tiny",
    mixer="kdn_diag",
    layer_pattern=layer_pattern,
    vocab_size=32,
    num_layers=2,
    d_model=32,
    num_heads=2,
    head_dim=8,
    mlp_hidden=32,
    chunk_size=8,
    swa_window=8,
    impl="reference",
  )
  c.data.kind = "mqar"
  c.data.seq_len = 16
  c.data.global_batch_size = 8
  c.data.eval_batch_size = 8
  c.data.num_eval_examples = 16
  c.data.prefetch = 0
  c.data.mqar.vocab_size = 32
  c.data.mqar.num_kv_pairs = 2
  c.train.initial_state = initial_state
  c.train.num_steps = 6
  c.train.log_every = 1
  c.train.eval_batches = 1
  c.optim.learning_rate = 1e-2
  c.optim.warmup_steps = 1
  c.checkpoint.enabled = False
  c.checkpoint.async_save = False
  c.logging.tensorboard = False
  c.logging.plot = False
  for k, v in data_overrides.items():
    c.data[k] = v
  return c


def write_doc_tokens(path, num_docs=24, eos=1, vocab=32, seed=0, min_len=10, max_len=60):
  """A 1-D .npy token file of random documents, each ending in ``eos``."""
  rng = np.random.default_rng(seed)
  docs = [
    np.append(rng.integers(2, vocab, size=rng.integers(min_len, max_len)), eos)
    for _ in range(num_docs)
  ]
  np.save(path, np.concatenate(docs).astype(np.int32))
  return docs


def write_array_record(path, docs):
  """``docs`` as an .array_record token file: one record of little-endian int32 tokens per document."""
  from array_record.python import array_record_module as arm  # pylint: disable=g-import-not-at-top

  w = arm.ArrayRecordWriter(str(path), "group_size:1")
  for d in docs:
    w.write(np.asarray(d, "<i4").tobytes())
  w.close()
  return str(path)


def host(tree):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(np.asarray, tree)


WORDS = (
  "the river ran past an old mill where children played and the miller sang of grain wind and "
  "stone while boats drifted slowly toward a distant harbor under grey clouds"
).split()


def _texts(n, rng, lo, hi):
  return [
    " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))).capitalize() + "." for _ in range(n)
  ]


def write_tiny_corpus(out, seed=0):
  """A corpus directory in prepare's format: tokenizer.json, {train,val,long_eval}.npy + .docs.npy, manifest."""
  rng = np.random.default_rng(seed)
  splits = {
    "train": _texts(60, rng, 20, 80),
    "val": _texts(20, rng, 20, 80),
    "long_eval": _texts(3, rng, 500, 600),
  }
  tok = BPETokenizer.train(splits["train"], vocab_size=300)
  tok.save(out)
  for name, texts in splits.items():
    docs = [np.append(tok.encode(t), tok.eos_id) for t in texts]
    np.save(os.path.join(out, f"{name}.npy"), np.concatenate(docs).astype(np.int32))
    np.save(
      os.path.join(out, f"{name}.docs.npy"),
      np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
    )
  with open(os.path.join(out, corpus.MANIFEST), "w", encoding="utf-8") as f:
    json.dump({"vocab_size": tok.vocab_size, "eos_id": tok.eos_id}, f)
  return tok


def train_tiny_lm(base, num_steps=3):
  """A checkpointed run of a tiny KDN + attention LM on a tiny corpus under ``base``: (workdir, corpus dir)."""
  from experiments.runner import trainer  # pylint: disable=g-import-not-at-top

  cdir = os.path.join(str(base), "corpus")
  os.makedirs(cdir)
  write_tiny_corpus(cdir)
  c = tiny_config(kind="token_file", layer_pattern="kdn_diag,attention")
  c.model.vocab_size = 320
  c.data.corpus_dir = cdir
  c.data.seq_len = 32
  c.train.num_steps = num_steps
  c.checkpoint.enabled = True
  workdir = os.path.join(str(base), "run")
  tr = trainer.Trainer(c, workdir)
  try:
    tr.run()
  finally:
    tr.close()
  return workdir, cdir
