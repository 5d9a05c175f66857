"""Copying with copy lengths drawn from a range (data.copying.min_copy_len): structure, determinism, the
pipeline wiring and config validation."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import schema
from experiments.data import pipeline, synthetic
from kdn_jax.models.config import model_config


def _copy_len(ex) -> int:
  return int(ex["mask"].sum())


def test_fixed_length_is_unchanged():
  a = synthetic.copying_example(3, seed=5, seq_len=40, vocab_size=32, copy_len=8)
  for m in (0, 8):  # 0 and min == max both mean "fixed": the same draws as without the option
    b = synthetic.copying_example(3, seed=5, seq_len=40, vocab_size=32, copy_len=8, min_copy_len=m)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_range_structure_and_determinism():
  lens = []
  for i in range(200):
    ex = synthetic.copying_example(
      i, seed=1, seq_len=41, vocab_size=16, copy_len=20, min_copy_len=5
    )
    again = synthetic.copying_example(
      i, seed=1, seq_len=41, vocab_size=16, copy_len=20, min_copy_len=5
    )
    for k in ex:
      np.testing.assert_array_equal(ex[k], again[k])
    n = _copy_len(ex)
    inp, tgt, m = ex["inputs"], ex["targets"], ex["mask"].astype(bool)
    assert inp[0] == 1 and inp[n + 1] == 2  # BOS, SEP
    assert ((inp[1 : n + 1] >= 3) & (inp[1 : n + 1] < 16)).all()
    np.testing.assert_array_equal(np.flatnonzero(m), np.arange(n + 1, 2 * n + 1))
    np.testing.assert_array_equal(tgt[m], inp[1 : n + 1])
    assert (inp[2 * n + 2 :] == 0).all()  # padding after the copy
    lens.append(n)
  assert min(lens) == 5 and max(lens) == 20  # both ends of the range are drawn
  with pytest.raises(ValueError, match="min_copy_len"):
    synthetic.copying_example(0, seed=0, seq_len=41, vocab_size=16, copy_len=20, min_copy_len=21)
  with pytest.raises(ValueError, match="seq_len"):
    synthetic.copying_example(0, seed=0, seq_len=40, vocab_size=16, copy_len=20)


def _config(**copying):
  c = schema.base_config()
  c.model = model_config("tiny", vocab_size=32)
  c.data.kind = "copying"
  c.data.seq_len = 41
  c.data.global_batch_size = 8
  c.data.eval_batch_size = 8
  c.data.num_train_examples = 64
  c.data.num_eval_examples = 16
  c.data.read_threads = 1
  c.data.prefetch = 0
  c.train.num_steps = 2
  c.data.copying.vocab_size = 32
  for k, v in copying.items():
    c.data.copying[k] = v
  return c


def test_pipeline_and_validation():
  c = schema.validate(_config(copy_len=20, min_copy_len=10))
  batch = next(pipeline.make_train_iterator(c))
  lens = batch["mask"].sum(1)
  assert batch["inputs"].shape == (8, 41) and lens.min() >= 10 and lens.max() <= 20
  assert len(set(lens.tolist())) > 1
  ev = pipeline.make_eval_batches(
    schema.validate(_config(copy_len=20, min_copy_len=10, eval_copy_len=12))
  )
  assert (ev[0]["mask"].sum(1) == 12).all()  # eval_copy_len fixes the validation length
  for kw, key in (
    ({"copy_len": 20, "min_copy_len": 21}, "min_copy_len"),
    ({"copy_len": 20, "min_copy_len": -1}, "min_copy_len"),
    ({"copy_len": 21}, "copy_len"),
    ({"copy_len": 0}, "copy_len"),
  ):
    with pytest.raises(schema.ConfigError, match=f"data.copying.{key}"):
      schema.validate(_config(**kw))
