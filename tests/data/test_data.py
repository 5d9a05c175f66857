"""Input pipelines: synthetic tasks, token files, grain iterator checkpointing, missing files."""

from __future__ import annotations

import numpy as np
import pytest
from runner_helpers import tiny_config, write_doc_tokens

from experiments import config_checks
from experiments.data import pipeline, synthetic, token_files


def test_mqar_structure_and_determinism():
  ex = synthetic.mqar_example(7, seed=1, seq_len=64, vocab_size=64, num_kv_pairs=8)
  ex2 = synthetic.mqar_example(7, seed=1, seq_len=64, vocab_size=64, num_kv_pairs=8)
  for k in ex:
    np.testing.assert_array_equal(ex[k], ex2[k])
  inp, tgt, mask = ex["inputs"], ex["targets"], ex["mask"]
  kv = dict(zip(inp[0:16:2], inp[1:16:2]))
  assert len(kv) == 8 and all(1 <= k < 32 for k in kv) and all(32 <= v < 64 for v in kv.values())
  q = np.flatnonzero(mask)
  assert len(q) == 8 and (q >= 16).all()
  for p in q:
    assert tgt[p] == kv[inp[p]]  # the scored target after a query key is its value
  assert sorted(inp[q]) == sorted(kv)


def test_copying_and_passkey():
  ex = synthetic.copying_example(0, seed=0, seq_len=40, vocab_size=32, copy_len=8)
  m = ex["mask"].astype(bool)
  np.testing.assert_array_equal(ex["targets"][m], ex["inputs"][1:9])
  ex = synthetic.passkey_example(0, seed=0, seq_len=64, vocab_size=64, digits=5)
  m = ex["mask"].astype(bool)
  key_pos = int(np.flatnonzero(ex["inputs"] == 1)[0])
  np.testing.assert_array_equal(ex["targets"][m], ex["inputs"][key_pos + 1 : key_pos + 6])


def test_grain_iterator_state_roundtrip():
  c = tiny_config()
  c.data.prefetch = 2
  it = pipeline.make_train_iterator(c)
  for _ in range(3):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(2)]
  it2 = pipeline.make_train_iterator(c)
  it2.set_state(state)
  got = [next(it2) for _ in range(2)]
  for w, g in zip(want, got):
    np.testing.assert_array_equal(w["inputs"], g["inputs"])
  # per-process shards are disjoint halves of the same global stream
  a = next(pipeline.make_train_iterator(c, 0, 2))["inputs"]
  b = next(pipeline.make_train_iterator(c, 1, 2))["inputs"]
  assert a.shape == (4, 16) and not np.array_equal(a, b)


def test_token_file_windows_and_missing(tmp_path):
  path = str(tmp_path / "tok.npy")
  np.save(path, np.arange(1000, dtype=np.int32) % 32)
  src = token_files.WindowSource(token_files.load_tokens(path), 16)
  ex = src[3]
  np.testing.assert_array_equal(ex["inputs"], np.arange(48, 64) % 32)
  np.testing.assert_array_equal(ex["targets"], np.arange(49, 65) % 32)
  c = tiny_config(kind="token_file", train_path=path)
  batch = next(pipeline.make_train_iterator(c))
  assert batch["inputs"].shape == (8, 16)
  c = tiny_config(kind="token_file", train_path=str(tmp_path / "nope.npy"))
  with pytest.raises(FileNotFoundError, match=r"data\.train_path.*nope\.npy"):
    config_checks.check(c)


def test_documents_split_on_eos(tmp_path):
  path = str(tmp_path / "docs.npy")
  docs = write_doc_tokens(path, num_docs=5, eos=1)
  spans = token_files.documents(np.load(path), 1)
  assert [b - a for a, b in spans] == [len(d) for d in docs]


@pytest.mark.parametrize("examples,batch,processes", [(10, 64, 1), (10, 64, 2), (20, 8, 1)])
def test_eval_batches_score_every_example_once(examples, batch, processes):
  """An evaluation set smaller than one batch, or not a whole number of batches: every example is scored
  exactly once (the rows that fill the last batch are masked out), on every process split."""
  c = tiny_config(num_eval_examples=examples, eval_batch_size=batch)
  c.train.eval_batches = 0
  ds = pipeline._map_dataset(c, "eval")
  rows = [
    (b["inputs"][r], b["mask"][r])
    for p in range(processes)
    for b in pipeline.make_eval_batches(c, p, processes)
    for r in range(len(b["inputs"]))
  ]
  assert len(rows) == -(-examples // batch) * batch
  scored = [(x, m) for x, m in rows if m.any()]
  assert len(scored) == examples  # each once; the padding carries no weight
  want = sorted(ds[i]["inputs"].tobytes() for i in range(examples))
  assert sorted(x.tobytes() for x, _ in scored) == want
  assert sum(m.sum() for _, m in rows) == sum(ds[i]["mask"].sum() for i in range(examples))
