"""Packed documents (segment_ids from document offsets) and post-training from a checkpoint (init_from)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from runner_helpers import host, tiny_config, write_array_record, write_doc_tokens

from experiments import schema
from experiments.data import pipeline, token_files
from experiments.runner import trainer
from kdn_jax.models.lm import LanguageModel


def test_segment_ids_follow_document_offsets(tmp_path):
  path = str(tmp_path / "tok.npy")
  toks = np.arange(40, dtype=np.int32)
  np.save(path, toks)
  off = np.array([0, 5, 13, 40], np.int64)
  np.save(token_files.docs_path(path), off)
  got = token_files.load_offsets(path, toks)
  np.testing.assert_array_equal(got, off)
  src = token_files.WindowSource(toks, 8, got)
  ex = src[
    0
  ]  # inputs 0..7: doc 0's inputs are positions 0..3 (targets 1..4), doc 1 starts at input 4
  np.testing.assert_array_equal(ex["segment_ids"], [0, 0, 0, 0, 1, 1, 1, 1])
  ex = src[
    1
  ]  # inputs 8..15: doc 1 through input 11 (its last target is token 12), doc 2 from input 12
  np.testing.assert_array_equal(ex["segment_ids"], [0, 0, 0, 0, 1, 1, 1, 1])
  # every target of a segment lies inside one document
  for i in range(len(src)):
    ex = src[i]
    doc_of_target = np.searchsorted(off, ex["targets"], side="right") - 1
    for s in np.unique(ex["segment_ids"]):
      assert len(set(doc_of_target[ex["segment_ids"] == s])) == 1
  np.save(token_files.docs_path(path), np.array([0, 5, 39]))
  with pytest.raises(ValueError, match="docs.npy"):
    token_files.load_offsets(path, toks)
  # without a sidecar, offsets come from the separator token
  eos_path = str(tmp_path / "eos.npy")
  docs = write_doc_tokens(eos_path, num_docs=4, eos=1)
  off = token_files.load_offsets(eos_path, np.load(eos_path), eos_id=1)
  np.testing.assert_array_equal(np.diff(off), [len(d) for d in docs])
  assert token_files.load_offsets(eos_path, np.load(eos_path), eos_id=-1) is None


def test_pipeline_batches_carry_segment_ids(tmp_path):
  path = str(tmp_path / "docs.npy")
  write_doc_tokens(path, num_docs=30, eos=1, min_len=5, max_len=12)
  c = tiny_config(kind="token_file", train_path=path, eos_id=1)
  batch = next(pipeline.make_train_iterator(c))
  seg = batch["segment_ids"]
  assert seg.shape == batch["inputs"].shape
  # a new segment starts at every separator in the inputs (the EOS is the next document's BOS)
  starts = np.diff(seg, axis=1) != 0
  np.testing.assert_array_equal(starts, batch["inputs"][:, 1:] == 1)
  # The same documents as an .array_record file (one record each, boundaries from the records, no
  # separator id needed) give the same batches.
  tokens = np.load(path)
  rec = write_array_record(
    tmp_path / "docs.array_record", np.split(tokens, np.flatnonzero(tokens == 1)[:-1] + 1)
  )
  rc = tiny_config(kind="token_file", train_path=rec, eos_id=-1)
  rbatch = next(pipeline.make_train_iterator(rc))
  for key in ("inputs", "targets", "mask", "segment_ids"):
    np.testing.assert_array_equal(rbatch[key], batch[key], err_msg=key)
  c.data.pack_documents = False
  assert "segment_ids" not in next(pipeline.make_train_iterator(c))


def _nll(logits, targets):
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return -np.asarray(jnp.take_along_axis(lp, targets[..., None], -1)[..., 0])


def test_packed_batch_equals_documents_run_separately():
  cfg = tiny_config(layer_pattern="kdn_diag,attention").model  # a recurrent and an attention layer
  cfg.impl = "chunked"
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  eos = 1
  docs = [np.append(rng.integers(2, 32, size=n), eos) for n in (6, 11, 4)]
  stream = np.concatenate([[eos]] + docs).astype(np.int32)  # a leading EOS acts as the first BOS
  off = np.concatenate([[0, 1], 1 + np.cumsum([len(d) for d in docs])])  # the leading EOS is doc 0
  inputs, targets = stream[:-1], stream[1:]
  seg = token_files.segment_ids(off, 0, len(inputs))
  alone_inputs = [np.concatenate([[eos], d[:-1]]).astype(np.int32)[None] for d in docs]

  @nnx.jit
  def forwards(
    m, x, s, xs
  ):  # every forward of the test in one compiled program (eager: a compile per op)
    return m(x, segment_ids=s)[0], [m(a)[0] for a in xs], m(x)[0]

  logits, alone_logits, lg_nos = forwards(
    model, jnp.asarray(inputs[None]), jnp.asarray(seg[None]), [jnp.asarray(a) for a in alone_inputs]
  )
  packed = _nll(logits, jnp.asarray(targets[None]))[0]
  pos = 0
  for d, lg in zip(docs, alone_logits):
    alone = _nll(lg, jnp.asarray(d[None].astype(np.int32)))[0]
    np.testing.assert_allclose(packed[pos : pos + len(d)], alone, rtol=1e-4, atol=1e-4)
    pos += len(d)
  assert pos == len(targets)
  # and without segment ids the later documents do see the earlier ones
  assert np.abs(_nll(lg_nos, jnp.asarray(targets[None]))[0] - packed).max() > 1e-3


def _run(config, workdir):
  tr = trainer.Trainer(config, str(workdir))
  try:
    summary = tr.run()
    return summary, host(tr.state["params"]), tr
  finally:
    tr.close()


def test_init_from_restores_params_only_and_runs_a_new_strategy(tmp_path):
  c = tiny_config("zero")
  c.checkpoint.enabled, c.train.num_steps = True, 4
  _, pre_params, _ = _run(c, tmp_path / "pre")

  post = tiny_config("state_passing")
  post.checkpoint.enabled, post.train.num_steps = True, 3
  post.train.init_from = str(tmp_path / "pre")
  tr = trainer.Trainer(post, str(tmp_path / "post"))
  try:
    assert tr.step() == 0 and tr.init_from_step == 4
    for a, b in zip(jax.tree.leaves(host(tr.state["params"])), jax.tree.leaves(pre_params)):
      np.testing.assert_array_equal(a, b)
    # a fresh optimizer: every Adam moment is zero
    mu = [
      x
      for x in jax.tree.leaves(host(tr.state["opt_state"]))
      if x.ndim > 0 and x.dtype == np.float32
    ]
    assert mu and all(not np.any(x) for x in mu)
    summary = tr.run()
  finally:
    tr.close()
  assert summary["status"] == "completed" and summary["step"] == 3
  assert summary["init_from_step"] == 4 and summary["initial_state"] == "state_passing"
  assert np.isfinite(summary["train"]["loss"])
  # the post-training workdir resumes from its own checkpoint, not from the source again
  post.train.num_steps = 4
  s2, _, _ = _run(post, tmp_path / "post")
  assert s2["steps_this_run"] == 1 and s2["init_from_step"] == 4

  # a workdir cannot silently switch strategy on resume
  switched = tiny_config("zero")
  switched.checkpoint.enabled = True
  with pytest.raises(schema.ConfigError, match=r"initial_state.*'state_passing'.*init_from"):
    trainer.Trainer(switched, str(tmp_path / "post"))


def test_init_from_errors_before_training(tmp_path):
  c = tiny_config()
  c.train.init_from = str(tmp_path / "nowhere")
  with pytest.raises(schema.ConfigError, match=r"config\.train\.init_from: no such directory"):
    trainer.Trainer(c, str(tmp_path / "a"))
  os.makedirs(tmp_path / "empty")
  c.train.init_from = str(tmp_path / "empty")
  with pytest.raises(schema.ConfigError, match=r"init_from: no checkpoint"):
    trainer.Trainer(c, str(tmp_path / "b"))
  src = tiny_config()
  src.checkpoint.enabled, src.train.num_steps = True, 1
  _run(src, tmp_path / "src")
  wider = tiny_config()
  wider.model.mlp_hidden = 48
  wider.train.init_from = str(tmp_path / "src" / "checkpoints" / "1")  # one step directory
  with pytest.raises(schema.ConfigError, match=r"does not fit this model.*mlp.*\(32, 48\)"):
    trainer.Trainer(wider, str(tmp_path / "c"))
