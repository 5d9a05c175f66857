"""Evaluation task grids (experiments/data/retrieval.py): S-NIAH-1/2/3, passkey, copying, MQAR, scoring."""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest

from experiments.data import retrieval, snih
from experiments.data.tokenizer import BPETokenizer

_WORDS = (
  "cat dog bird tree house river mountain city road car ran jumped saw found liked the a big small "
  "old new happy sad one special magic number for is what mentioned in provided text"
).split()


def _docs(seed: int, n: int, extra: str = "") -> list[str]:
  rng = np.random.default_rng(seed)
  return [
    " ".join(" ".join(rng.choice(_WORDS, 6)) + "." + extra for _ in range(12)) for _ in range(n)
  ]


def _corpus(tok, docs) -> np.ndarray:
  return np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs]).astype(np.int32)


@pytest.fixture(scope="module")
def tok():
  return BPETokenizer.train(_docs(0, 80) + [snih.NOISE] * 5, vocab_size=400)


@pytest.fixture(scope="module")
def corpus(tok):
  return _corpus(tok, _docs(1, 40))


def _seq(ex, b):
  return np.concatenate([ex["inputs"][b], ex["targets"][b, -1:]])


def _haystack(ex, b, meta):
  """The haystack tokens of example b: the sequence without the needle and the query + answer."""
  s, ns, nl, size = _seq(ex, b), meta["needle_start"], meta["needle_len"], meta["haystack_len"]
  return np.concatenate([s[:ns], s[ns + nl : nl + size]])


def _find(needle: np.ndarray, hay: np.ndarray) -> int:
  win = np.lib.stride_tricks.sliding_window_view(hay, len(needle))
  hits = np.flatnonzero((win == needle).all(axis=1))
  return int(hits[0]) if len(hits) else -1


@pytest.mark.parametrize("task", ["snih1", "snih2", "snih3"])
def test_snih_structure(tok, corpus, task):
  hay_tokens = None if task == "snih1" else corpus
  lengths, depths = (512, 1024), (0.0, 0.5, 1.0)
  cells = retrieval.grid(
    task, lengths, depths, 4, seed=3, tokenizer=tok, haystack_tokens=hay_tokens
  )
  assert [(c["length"], c["depth"]) for c in cells] == [(l, d) for l in lengths for d in depths]
  for cell in cells:
    ex, length, depth = cell["examples"], cell["length"], cell["depth"]
    assert cell["axis"] == "depth" and cell["task"] == task
    assert ex["inputs"].shape == ex["targets"].shape == ex["mask"].shape == (4, length)
    assert ex["inputs"].dtype == np.int32 and ex["mask"].dtype == np.float32
    np.testing.assert_array_equal(ex["targets"][:, :-1], ex["inputs"][:, 1:])
    for b, meta in enumerate(cell["meta"]):
      key, value = meta["key"], meta["value"]
      if task == "snih3":
        assert uuid.UUID(value).version == 4 and str(uuid.UUID(value)) == value
      else:
        assert re.fullmatch(r"[1-9]\d{6}", value)
      m = ex["mask"][b] > 0
      # the scored positions are exactly the last answer_len ones and their targets decode to the value
      np.testing.assert_array_equal(
        np.flatnonzero(m), np.arange(length - meta["answer_len"], length)
      )
      assert tok.decode(ex["targets"][b][m]) == " " + value
      s = _seq(ex, b)
      ns, nl, size = meta["needle_start"], meta["needle_len"], meta["haystack_len"]
      assert (
        tok.decode(s[ns : ns + nl]) == f" One of the special magic numbers for {key} is: {value}."
      )
      assert (
        nl + size + len(tok.encode(snih.QUERY.format(key=key))) + meta["answer_len"] == length + 1
      )
      # depth: the needle starts within the snapping window of depth * haystack length
      assert abs(ns - depth * size) <= min(32, size // 10) + 0.5
      # no collisions: the key occurs only in the needle and twice in the query, the value once in the inputs
      text = tok.decode(ex["inputs"][b])
      assert text.count(key) == 3 and text.count(value) == 1
      assert key not in tok.decode(_haystack(ex, b, meta))
      if task != "snih1":
        assert tok.eos_id not in ex["inputs"][b]  # drop_eos
  # the same (seed, index) draws the same needle at every depth and length (paired cells)
  assert len({c["meta"][1]["key"] for c in cells}) == 1
  assert len({c["meta"][0]["key"] for c in cells} | {c["meta"][1]["key"] for c in cells}) == 2


def test_snih_haystacks(tok, corpus):
  # snih1: the tiled noise, starting at its beginning
  cell = retrieval.grid("snih1", [600], [0.3], 2, seed=0, tokenizer=tok)[0]
  unit = tok.encode(" " + snih.NOISE)
  hay = _haystack(cell["examples"], 0, cell["meta"][0])
  np.testing.assert_array_equal(hay, np.tile(unit, len(hay) // len(unit) + 1)[: len(hay)])
  noise_words = set(re.findall(r"[a-z]+", snih.NOISE.lower()))
  assert not noise_words & (set(snih.ADJECTIVES) | set(snih.NOUNS))
  # snih2: a contiguous window of the EOS-free corpus, at a seeded offset; the needle sits between sentences
  nz = corpus[corpus != tok.eos_id]
  cell = retrieval.grid("snih2", [700], [0.5], 3, seed=0, tokenizer=tok, haystack_tokens=corpus)[0]
  starts = []
  for b, meta in enumerate(cell["meta"]):
    hay = _haystack(cell["examples"], b, meta)
    starts.append(_find(hay, nz))
    assert starts[-1] >= 0
    assert tok.decode(hay[: meta["needle_start"]]).endswith(".")  # snapped to a sentence end
  assert len(set(starts)) == 3


def test_snih_key_and_value_collisions(tok):
  words = dict(adjectives=("red", "blue"), nouns=("cat", "dog"))
  hay = _corpus(tok, _docs(2, 30, extra=" red-cat, Blue-Cat and red-dog."))
  cells = retrieval.grid(
    "snih2", [400], [0.5], 12, seed=0, tokenizer=tok, haystack_tokens=hay, **words
  )
  assert {m["key"] for m in cells[0]["meta"]} == {
    "blue-dog"
  }  # the only key absent from the haystack
  hay = _corpus(tok, _docs(2, 30, extra=" red-cat, blue-cat, blue-dog and red-dog."))
  with pytest.raises(ValueError, match="no key/value absent"):
    retrieval.grid(
      "snih2", [400], [0.5], 2, seed=0, tokenizer=tok, haystack_tokens=hay, max_tries=20, **words
    )
  # one-digit values: the corpus holds 1..8 everywhere, so only 9 may be drawn
  hay = _corpus(tok, _docs(2, 30, extra=" 1 2 3 4 5 6 7 8."))
  cells = retrieval.grid(
    "snih2", [400], [0.5], 12, seed=0, tokenizer=tok, haystack_tokens=hay, value_digits=1
  )
  assert {m["value"] for m in cells[0]["meta"]} == {"9"}


def test_determinism(tok, corpus):
  def run(seed, task="snih2"):
    return retrieval.grid(
      task,
      [512],
      [0.25, 0.75],
      3,
      seed=seed,
      tokenizer=tok,
      haystack_tokens=None if task == "snih1" else corpus,
    )

  for task in ("snih1", "snih2"):
    a, b, c = run(0, task), run(0, task), run(1, task)
    for ca, cb, cc in zip(a, b, c):
      for k in ca["examples"]:
        np.testing.assert_array_equal(ca["examples"][k], cb["examples"][k])
      assert ca["meta"] == cb["meta"]
      assert not np.array_equal(ca["examples"]["inputs"], cc["examples"]["inputs"])
      assert [m["value"] for m in ca["meta"]] != [m["value"] for m in cc["meta"]]
  for task, kw in (("passkey", {}), ("copy", {}), ("mqar", {"points": [4]})):
    g = lambda s: retrieval.grid(task, [64], num_examples=2, seed=s, vocab_size=64, **kw)[0][
      "examples"
    ]["inputs"]
    np.testing.assert_array_equal(g(0), g(0))
    assert not np.array_equal(g(0), g(1))
  # the lazy per-cell function gives the grid's examples
  fn = retrieval.example_fn("snih2", 512, 0.75, seed=0, tokenizer=tok, haystack_tokens=corpus)
  np.testing.assert_array_equal(fn(2)["inputs"], run(0)[1]["examples"]["inputs"][2])


def test_passkey_grid():
  d = 5
  cells = retrieval.grid("passkey", [64, 300], [0.0, 0.5, 1.0], 3, seed=0, vocab_size=64, digits=d)
  for cell in cells:
    length, depth, ex = cell["length"], cell["depth"], cell["examples"]
    assert ex["inputs"].shape == (3, length)
    np.testing.assert_array_equal(ex["targets"][:, :-1], ex["inputs"][:, 1:])
    want = round(depth * (length - 2 * d - 2))
    for b, meta in enumerate(cell["meta"]):
      inp = ex["inputs"][b]
      assert meta["key_pos"] == want and np.flatnonzero(inp == 1).tolist() == [want]
      m = ex["mask"][b] > 0
      np.testing.assert_array_equal(np.flatnonzero(m), np.arange(length - d, length))
      np.testing.assert_array_equal(ex["targets"][b][m], inp[want + 1 : want + 1 + d])
      assert (
        inp[length - d] == 2
        and ((inp[want + 1 : want + 1 + d] >= 10) & (inp[want + 1 : want + 1 + d] < 20)).all()
      )
  assert cells[2]["meta"][0]["key_pos"] == 64 - 2 * d - 2  # depth 1: the last slot before QUERY


def test_copy_and_mqar_grids():
  cells = retrieval.grid("copy", [41, 100], num_examples=2, seed=0, vocab_size=32)
  assert [c["copy_len"] for c in cells] == [20, 49] and cells[0]["axis"] == "copy_len"
  for cell in cells + retrieval.grid("copy", [100], [10, 30], 2, seed=0, vocab_size=32):
    ex, n = cell["examples"], cell["copy_len"]
    assert ex["inputs"].shape == (2, cell["length"]) and ex["mask"].sum(1).tolist() == [n, n]
    for b in range(2):
      m = ex["mask"][b] > 0
      np.testing.assert_array_equal(ex["targets"][b][m], ex["inputs"][b][1 : 1 + n])
  cells = retrieval.grid("mqar", [64, 128], [4, 16], 2, seed=0, vocab_size=64)
  assert [(c["length"], c["num_kv_pairs"]) for c in cells] == [
    (64, 4),
    (64, 16),
    (128, 4),
    (128, 16),
  ]
  for cell in cells:
    assert cell["examples"]["inputs"].shape == (2, cell["length"])
    assert (cell["examples"]["mask"].sum(1) == cell["num_kv_pairs"]).all()
  cells = retrieval.grid("mqar", [64], [4], 3, seed=0, vocab_size=64, stack=False)
  assert isinstance(cells[0]["examples"], list) and len(cells[0]["examples"]) == 3


def test_errors(tok, corpus, monkeypatch):
  with pytest.raises(ValueError, match="unknown task"):
    retrieval.grid("niah", [512])
  with pytest.raises(ValueError, match="tokenizer="):
    retrieval.grid("snih1", [512])
  for task in ("snih2", "snih3"):
    with pytest.raises(ValueError, match="haystack_tokens="):
      retrieval.grid(task, [512], tokenizer=tok)
  with pytest.raises(ValueError, match="vocab_size="):
    retrieval.grid("passkey", [512])
  with pytest.raises(ValueError, match="num_kv_pairs"):
    retrieval.grid("mqar", [512], vocab_size=64)
  with pytest.raises(ValueError, match="unknown argument"):
    retrieval.grid("snih1", [512], tokenizer=tok, digits=3)
  with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
    retrieval.grid("snih1", [512], [1.5], tokenizer=tok)
  # lengths too short for needle + query + answer; checked for every cell before any example is made
  calls = []
  monkeypatch.setattr(snih, "snih_example", lambda *a, **k: calls.append(1))
  need = retrieval.min_length("snih1", tokenizer=tok)
  with pytest.raises(ValueError, match="too short"):
    retrieval.grid("snih1", [1024, need - 1], tokenizer=tok)
  with pytest.raises(ValueError, match="fewer than the longest length"):
    retrieval.grid("snih2", [1024, len(corpus) + 5], tokenizer=tok, haystack_tokens=corpus)
  assert not calls
  monkeypatch.undo()
  cell = retrieval.grid("snih1", [need], [0.5], 4, tokenizer=tok)[0]  # the bound is sufficient
  assert cell["examples"]["inputs"].shape == (4, need)
  with pytest.raises(ValueError, match="too short"):
    snih.snih_example(0, seed=0, seq_len=20, depth=0.5, tokenizer=tok)
  with pytest.raises(ValueError, match="too short"):
    retrieval.grid("passkey", [11], vocab_size=64, digits=5)
  with pytest.raises(ValueError, match="too short"):
    retrieval.grid("copy", [40], [20], vocab_size=32)
  with pytest.raises(ValueError, match="too short"):
    retrieval.grid("mqar", [30], [8], vocab_size=64)


def test_score():
  mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
  correct = np.array([[0, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  s = retrieval.score(correct, mask)
  assert s["exact_match"] == pytest.approx(2 / 3)  # row 3 has no scored positions
  assert s["token_accuracy"] == pytest.approx(5 / 6)
  assert (s["num_examples"], s["num_tokens"]) == (3, 6)
  assert s["per_example"].tolist() == [True, False, True, True]
  targets = np.arange(16).reshape(4, 4)
  pred = np.where(correct, targets, -1)
  assert retrieval.score_predictions(pred, targets, mask)["exact_match"] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="shape"):
    retrieval.score(correct[:, :3], mask)
