"""MQAR mixture batches (experiments/data/mqar_mixture.py): every row is a valid MQAR example of its cell,
padded after its end; the rows follow the per-example generator's distribution; the config wires them."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import schema
from experiments.data import mqar_mixture, pipeline, synthetic
from tests.runner_helpers import tiny_config

CELLS = ((16, 2, 3.0), (32, 4, 1.0), (64, 16, 1.0))


def _check_row(inp, tgt, mask, t, n, vocab):
  seq = np.concatenate([inp, tgt[-1:]])
  keys, values = seq[0 : 2 * n : 2], seq[1 : 2 * n : 2]
  assert len(set(keys.tolist())) == n and np.all((keys >= 1) & (keys < vocab // 2))
  assert np.all((values >= vocab // 2) & (values < vocab))
  q = np.flatnonzero(mask)
  assert len(q) == n and np.all(q >= 2 * n) and np.all(q < t) and np.all((q - 2 * n) % 2 == 0)
  assert sorted(inp[q].tolist()) == sorted(keys.tolist())  # every key queried once
  lookup = dict(zip(keys.tolist(), values.tolist()))
  assert all(tgt[p] == lookup[inp[p]] for p in q)  # the target after a query is its value
  assert (
    np.all(inp[t:] == 0) and np.all(tgt[t:] == 0) and np.all(mask[t:] == 0)
  )  # padding after the row


def test_rows_are_valid_examples_of_their_cells_and_deterministic():
  b = mqar_mixture.batch(3, 7, CELLS, 400, 64, vocab_size=64)
  for r in range(400):
    t, n, _ = CELLS[b["cell"][r]]
    _check_row(b["inputs"][r], b["targets"][r], b["mask"][r], t, n, 64)
  np.testing.assert_allclose(np.bincount(b["cell"], minlength=3) / 400, [0.6, 0.2, 0.2], atol=0.08)
  again = mqar_mixture.batch(3, 7, CELLS, 400, 64, vocab_size=64)
  assert all(np.array_equal(b[k], again[k]) for k in b)
  assert not np.array_equal(
    b["inputs"], mqar_mixture.batch(3, 8, CELLS, 400, 64, vocab_size=64)["inputs"]
  )
  with pytest.raises(ValueError, match="mqar_mixture"):
    mqar_mixture.batch(0, 0, ((128, 4),), 4, 64, vocab_size=64)


def test_a_batch_without_the_widest_cell_is_valid():
  # Every row drawn from the (16, 2) cell: fewer query slots than the widest cell's pairs.
  cells = ((16, 2, 1.0), (64, 16, 1e-9))
  b = mqar_mixture.batch(0, 0, cells, 4, 64, vocab_size=64)
  assert np.all(b["cell"] == 0)
  for r in range(4):
    _check_row(b["inputs"][r], b["targets"][r], b["mask"][r], 16, 2, 64)


def test_query_positions_and_keys_follow_the_per_example_generator():
  t, n, rows = 64, 8, 3000
  b = mqar_mixture.batch(1, 0, ((t, n),), rows, t, vocab_size=64)
  ref = [
    synthetic.mqar_example(i, seed=5, seq_len=t, vocab_size=64, num_kv_pairs=n) for i in range(rows)
  ]
  gap = lambda masks: (
    np.bincount(
      np.concatenate([(np.flatnonzero(m) - 2 * n) // 2 for m in masks]),
      minlength=(t + 1 - 2 * n) // 2,
    )
    / (rows * n)
  )
  np.testing.assert_allclose(gap(b["mask"]), gap([e["mask"] for e in ref]), atol=0.01)
  keys = lambda inputs: (
    np.bincount(np.concatenate([x[0 : 2 * n : 2] for x in inputs]), minlength=32)[1:32] / (rows * n)
  )
  np.testing.assert_allclose(keys(b["inputs"]), keys([e["inputs"] for e in ref]), atol=0.008)


def test_config_wires_the_mixture_into_the_pipeline():
  c = tiny_config(layer_pattern="kdn_diag")
  c.data.seq_len = 32
  c.data.mqar.mixture = "16:2:2,32:4"
  c.train.loss_positions = 4
  schema.validate(c)
  batch = next(pipeline.make_train_iterator(c))
  assert (
    batch["inputs"].shape == (8, 32) and "cell" not in batch and batch["mask"].sum(1).max() <= 4
  )
  assert len(pipeline.make_eval_batches(c)) == 1
  for bad, msg in (
    ("16:2,64:4", "longer than data.seq_len"),
    ("16:5", r"5 pairs need a length >= 20"),
    ("16-2", "expected"),
  ):
    c.data.mqar.mixture = bad
    with pytest.raises(schema.ConfigError, match=rf"config\.data\.mqar\.mixture: .*{msg}"):
      schema.validate(c)
  c.data.mqar.mixture = "16:2,32:8"
  with pytest.raises(schema.ConfigError, match=r"config\.train\.loss_positions: 4 is below the 8"):
    schema.validate(c)
