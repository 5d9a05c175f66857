"""The passkey TBTT stream: each slot reads one passkey document across consecutive chunks."""

import numpy as np
import pytest

from experiments import schema
from experiments.data import passkey_tbtt, pipeline


def test_slots_continue_one_document_across_chunks():
  t, b = 32, 3
  src = passkey_tbtt.PasskeyTBTTSource(
    seq_len=t, global_batch=b, steps=40, seed=7, vocab_size=64, digits=5, max_chunks=4
  )
  batches = [src[n] for n in range(len(src))]
  lengths_seen = set()
  for slot in range(b):
    starts = [n for n in range(len(src)) if batches[n]["reset"][slot]]
    assert starts[0] == 0
    for a, z in zip(starts, starts[1:]):
      index, n, c = src.slots[slot][a]
      assert c == 0 and z - a == n
      lengths_seen.add(n)
      doc = src.document(index, n)
      got = np.concatenate([batches[s]["inputs"][slot] for s in range(a, z)])
      np.testing.assert_array_equal(got, doc["inputs"])
      mask = np.concatenate([batches[s]["mask"][slot] for s in range(a, z)])
      assert mask[: (n - 1) * t].sum() == 0 and mask[(n - 1) * t :].sum() == 5  # the answer
      assert (got == 1).sum() == 1 and (got == 2).sum() == 1  # one KEY, one QUERY
  assert lengths_seen >= {2, 3, 4}
  # deterministic from the seed
  again = passkey_tbtt.PasskeyTBTTSource(
    seq_len=t, global_batch=b, steps=40, seed=7, vocab_size=64, digits=5, max_chunks=4
  )
  np.testing.assert_array_equal(again[13]["inputs"], batches[13]["inputs"])


def test_pipeline_serves_tbtt_passkey_batches():
  from configs import passkey

  c = passkey.get_config("cpu,gla,tbtt")
  c.train.num_steps = 3
  schema.validate(c)
  it = pipeline.make_train_iterator(c)
  batch = next(it)
  assert batch["inputs"].shape == (16, 128) and batch["reset"].all()


def test_bad_chunk_bound_is_one_line():
  from configs import passkey

  c = passkey.get_config("cpu,gla,tbtt")
  c.data.passkey.tbtt_chunks = 0
  with pytest.raises(schema.ConfigError, match="data.passkey.tbtt_chunks"):
    schema.validate(c)
