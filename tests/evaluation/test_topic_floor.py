"""The topic source in the data pipeline (zero-start windows, TBTT document streams, config checks)
and
the topic_floor analysis (excess over the floor, verdict, intervals)."""

from __future__ import annotations

import numpy as np
import pytest

from configs import lengen_synthetic
from experiments.data import pipeline
from experiments.data import topic_source as ts
from experiments.evaluation import topic_floor
from experiments.runner import config_lib


def _config(strategy="zero"):
  c = lengen_synthetic.get_config(f"tiny,gla,{strategy}")
  c.data.topic.doc_len = 256
  c.data.topic.num_train_docs = 32
  c.data.global_batch_size = 4
  c.data.seq_len = 64
  c.data.prefetch = 0
  c.data.read_threads = 1
  return c


def test_zero_start_windows_come_from_documents():
  c = _config()
  config_lib.validate(c, 1)
  src = ts.TopicSource(ts.params_from_config(c.data.topic))
  batch = next(pipeline.make_train_iterator(c))
  assert batch["inputs"].shape == (4, 64) and "reset" not in batch
  # every row is a window of some training document: find it among the 32 x 4 windows
  windows = {tuple(src.window(ts.TRAIN, d, k, 64)["targets"]) for d in range(32) for k in range(4)}
  assert all(tuple(row) in windows for row in batch["targets"])
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  ev = pipeline.make_eval_batches(c)
  assert ev[0]["inputs"].shape == (c.data.eval_batch_size, 64)


def test_tbtt_rows_read_their_documents_in_order():
  c = _config("tbtt")
  config_lib.validate(c, 1)
  src = ts.TopicSource(ts.params_from_config(c.data.topic))
  it = pipeline.make_train_iterator(c)
  batches = [next(it) for _ in range(6)]  # 4 windows per document: documents change at step 4
  assert [bool(b["reset"].all()) for b in batches] == [True, False, False, False, True, False]
  for row in range(4):
    doc = src.tokens(ts.TRAIN, row)
    got = np.concatenate([b["targets"][row] for b in batches[:4]])
    np.testing.assert_array_equal(got, doc)  # consecutive windows = the whole document
    assert batches[0]["inputs"][row, 0] == src.params.bos_id
    np.testing.assert_array_equal(batches[4]["targets"][row], src.tokens(ts.TRAIN, row + 4, 0, 64))


def test_config_errors_name_the_key():
  c = _config()
  c.data.topic.switch_prob = 2.0
  with pytest.raises(
    config_lib.ConfigError, match=r"config.data.topic.switch_prob: must be in \[0, 1\]"
  ):
    config_lib.validate(c)
  c = _config()
  c.model.vocab_size = 512
  with pytest.raises(config_lib.ConfigError, match="config.model.vocab_size: 512 does not cover"):
    config_lib.validate(c)
  c = _config("tbtt")
  c.data.topic.num_train_docs = 2
  with pytest.raises(config_lib.ConfigError, match="config.data.topic.num_train_docs"):
    config_lib.validate(c)
  c = _config()
  c.data.eval_seq_len = 512
  with pytest.raises(config_lib.ConfigError, match="config.data.topic.doc_len"):
    config_lib.validate(c)
  with pytest.raises(config_lib.ConfigError, match="unknown preset"):
    lengen_synthetic.get_config("huge,gla")


def _nll(rng, n, excess_early, excess_late, length=8192, train_len=64):
  """Per-position model and floor NLLs whose excess is excess_early before 4096 and excess_late
  after."""
  floor = rng.gamma(4.0, 1.0, (n, length))
  excess = np.where(np.arange(length) < 4096, excess_early, excess_late) + rng.normal(
    0, 0.3, (n, length)
  )
  return floor + excess, floor


def test_analysis_verdicts_and_intervals():
  rng = np.random.default_rng(0)
  fail = topic_floor.analyse(*_nll(rng, 24, 0.1, 0.5), 64, resamples=500)
  assert fail["verdict"] == "failure" and fail["verdict_ci"] == "failure"
  assert fail["ratio"]["lo"] < 5.0 < fail["ratio"]["hi"]
  assert (
    fail["late"]["lo"] < 0.5 < fail["late"]["hi"]
    and fail["early"]["lo"] < 0.1 < fail["early"]["hi"]
  )
  flat = topic_floor.analyse(*_nll(rng, 24, 0.1, 0.1), 64, resamples=500)
  assert flat["verdict"] == "no failure" and flat["verdict_ci"] == "no failure"
  close = topic_floor.analyse(*_nll(rng, 24, 0.1, 0.3), 64, resamples=500)  # at the threshold
  assert close["verdict_ci"] == "undecided"
  # the curve's buckets tile [0, length) and hold the verdict windows' edges
  edges = fail["bucket_edges"]
  assert edges[0] == 0 and edges[-1] == 8192 and {32, 64, 4096, 8192} <= set(edges)
  assert len(fail["excess"]["estimate"]) == len(edges) - 1 == len(fail["bucket_center"])
  assert fail["early_window"] == [32, 64] and fail["late_window"] == [4096, 8192]
  with pytest.raises(ValueError, match="--max_len"):
    topic_floor.analyse(np.zeros((3, 4096)), np.zeros((3, 4096)), 64)


def test_evaluation_documents_and_model_view():
  src = ts.TopicSource(ts.TopicParams(doc_len=9000))
  docs = topic_floor.evaluation_documents(src, 3, 8192, seed=1)
  inputs, targets = topic_floor.model_view(src, docs)
  assert inputs.shape == targets.shape == (3, 8192)
  assert (inputs[:, 0] == src.params.bos_id).all()
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  np.testing.assert_array_equal(docs[0], src.tokens(ts.EVAL, topic_floor.DOC_STRIDE, 0, 8192))
  assert not np.array_equal(docs, topic_floor.evaluation_documents(src, 3, 8192, seed=2))
  with pytest.raises(ValueError, match="--max_len"):
    topic_floor.evaluation_documents(src, 1, 9001)
