"""The topic source in the data pipeline (zero-start windows, TBTT document streams, config checks)
and
the topic_floor analysis (excess over the floor, verdict, intervals)."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from configs import lengen_synthetic
from experiments import schema
from experiments.data import pipeline
from experiments.data import topic_source as ts
from experiments.evaluation import topic_floor


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
  schema.check_mesh(schema.validate(c), 1)
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
  schema.check_mesh(schema.validate(c), 1)
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
    schema.ConfigError, match=r"config.data.topic.switch_prob: must be in \[0, 1\]"
  ):
    schema.validate(c)
  c = _config()
  c.model.vocab_size = 512
  with pytest.raises(schema.ConfigError, match="config.model.vocab_size: 512 does not cover"):
    schema.validate(c)
  c = _config("tbtt")
  c.data.topic.num_train_docs = 2
  with pytest.raises(schema.ConfigError, match="config.data.topic.num_train_docs"):
    schema.validate(c)
  c = _config()
  c.data.eval_seq_len = 512
  with pytest.raises(schema.ConfigError, match="config.data.topic.doc_len"):
    schema.validate(c)
  with pytest.raises(schema.ConfigError, match="unknown preset"):
    lengen_synthetic.get_config("huge,gla")


def _nll(rng, n, early_nll, late_nll, length=8192, floor_late=None):
  """Per-position model and floor NLLs: the model's mean NLL is early_nll before 4096 and late_nll
  after; the floor is 1 nat below the model before 4096 and floor_late (default: 1 below) after."""
  pos = np.arange(length)
  model = np.where(pos < 4096, early_nll, late_nll) + rng.normal(0, 0.3, (n, length))
  floor_after = late_nll - 1.0 if floor_late is None else floor_late
  floor = np.where(pos < 4096, early_nll - 1.0, floor_after) + 0 * model
  return model, floor


def test_analysis_verdicts_and_intervals():
  rng = np.random.default_rng(0)
  fail = topic_floor.analyse(*_nll(rng, 24, 3.0, 3.0 + np.log(2.0)), 64, resamples=500)
  assert fail["verdict"] == "failure"
  per_doc = np.asarray(fail["bucket_excess_per_document"])
  assert per_doc.shape == (24, len(fail["bucket_center"]))
  np.testing.assert_allclose(per_doc.mean(0), fail["excess"]["estimate"])
  assert fail["ppl_ratio"]["lo"] < 2.0 < fail["ppl_ratio"]["hi"]
  assert abs(fail["nll_late"]["estimate"] - (3.0 + np.log(2.0))) < 0.01
  # the gap to the floor is 1 nat in both windows: no growth
  assert fail["excess_growth"]["lo"] < 0 < fail["excess_growth"]["hi"]
  flat = topic_floor.analyse(*_nll(rng, 24, 3.0, 3.0, floor_late=1.5), 64, resamples=500)
  assert flat["verdict"] == "no failure" and flat["ppl_ratio"]["hi"] < 1.5
  # a model that stops gaining while the floor falls: no failure, its excess grows by 0.5 nats
  assert abs(flat["excess_growth"]["estimate"] - 0.5) < 0.05
  z = np.zeros(4)
  close = topic_floor.verdict(z, z, z, np.log([1.2, 1.3, 1.5, 1.8]), resamples=500)
  assert close["ppl_ratio"]["estimate"] < 1.5 < close["ppl_ratio"]["hi"]
  assert close["verdict"] == "undecided"  # below 1.5 but the interval reaches it
  # the rule's lower end: a ratio >= 1.5 whose interval dips under 1.3 is not a failure
  loose = topic_floor.verdict(z, z, z, np.log([1.0, 1.1, 2.5, 3.0]), resamples=500)
  assert loose["ppl_ratio"]["estimate"] >= 1.5 > 1.3 > loose["ppl_ratio"]["lo"]
  assert loose["verdict"] == "undecided"
  # the curve's buckets tile [0, length) and hold the verdict windows' edges
  edges = fail["bucket_edges"]
  assert edges[0] == 0 and edges[-1] == 8192 and {32, 64, 4096, 8192} <= set(edges)
  assert len(fail["excess"]["estimate"]) == len(edges) - 1 == len(fail["bucket_center"])
  assert fail["early_window"] == [32, 64] and fail["late_window"] == [4096, 8192]
  with pytest.raises(ValueError, match="--max_len"):
    topic_floor.analyse(np.zeros((3, 4096)), np.zeros((3, 4096)), 64)


def test_a_result_stored_without_the_verdict_fields_gets_them_from_the_floor():
  """with_verdict recomputes the floor of the recorded documents: the model NLLs it recovers from
  the stored excesses equal those a full analysis computes."""
  src_cfg = {
    "vocab_size": 16,
    "num_topics": 3,
    "zipf_exponent": 1.0,
    "switch_prob": 0.01,
    "doc_len": 8192,
    "seed": 2,
  }
  src = ts.TopicSource(ts.params_from_config(ml_collections.ConfigDict(src_cfg)))
  docs = topic_floor.evaluation_documents(src, 4, 8192, seed=1)
  floor = src.bayes_nll(docs)
  model = floor + np.random.default_rng(0).uniform(0, 0.2, floor.shape)
  full = topic_floor.analyse(model, floor, 64, seed=1, resamples=200)
  old = {k: v for k, v in full.items() if k not in ("ppl_ratio", "nll_early", "nll_late")}
  old["per_document"] = {k: full["per_document"][k] for k in ("early", "late")}
  old.update(source=src_cfg, seed=1, threshold=3.0, verdict_ci="failure")
  new = topic_floor.with_verdict(old, resamples=200)
  np.testing.assert_allclose(new["per_document"]["nll_late"], full["per_document"]["nll_late"])
  for k in ("estimate", "lo", "hi"):
    np.testing.assert_allclose(new["ppl_ratio"][k], full["ppl_ratio"][k], rtol=1e-12)
  assert new["verdict"] == full["verdict"]
  assert "threshold" not in new and "verdict_ci" not in new


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
