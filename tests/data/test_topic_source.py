"""The synthetic topic source: its Bayes floor against brute-force enumeration, document layout,
determinism and sampling statistics."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from experiments.data import topic_source as ts


def _brute_force_nll(tokens, emissions, switch_prob):
  """-log p(x_t | x_<t) from p(x_0..x_t) = the sum over every topic path of length t + 1 of its
  joint
  probability (no recursion shared with the filter)."""
  z = emissions.shape[0]
  trans = np.full((z, z), switch_prob / (z - 1))
  np.fill_diagonal(trans, 1.0 - switch_prob)
  prefix = [1.0]
  for t in range(1, len(tokens) + 1):
    total = 0.0
    for path in itertools.product(range(z), repeat=t):
      prob = 1.0 / z * emissions[path[0], tokens[0]]
      for s in range(1, t):
        prob *= trans[path[s - 1], path[s]] * emissions[path[s], tokens[s]]
      total += prob
    prefix.append(total)
  prefix = np.asarray(prefix)
  return -np.log(prefix[1:] / prefix[:-1])


def test_filter_equals_brute_force_enumeration():
  rng = np.random.default_rng(3)
  emissions = rng.dirichlet(
    np.ones(4) * 0.7, size=3
  )  # Z=3 topics over V=4 tokens, not Zipf on purpose
  for switch_prob in (0.0, 0.15, 0.9):
    tokens = rng.integers(0, 4, size=(5, 6))
    got = ts.bayes_nll(tokens, emissions, switch_prob)
    want = np.stack([_brute_force_nll(row, emissions, switch_prob) for row in tokens])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_source_floor_matches_brute_force_on_its_own_documents():
  src = ts.TopicSource(
    ts.TopicParams(
      vocab_size=4, num_topics=3, zipf_exponent=1.3, switch_prob=0.2, doc_len=6, seed=5
    )
  )
  docs = np.stack([src.tokens(ts.EVAL, d) for d in range(4)])
  want = np.stack([_brute_force_nll(row, src.emissions, 0.2) for row in docs])
  np.testing.assert_allclose(src.bayes_nll(docs), want, rtol=1e-12)
  # every topic is a Zipf law over a permutation of the vocabulary
  np.testing.assert_allclose(
    np.sort(src.emissions, axis=1)[:, ::-1], np.tile(src.rank_probs, (3, 1))
  )


def test_documents_carry_boundaries_and_windows_tile_them():
  p = ts.TopicParams(vocab_size=32, num_topics=4, switch_prob=0.05, doc_len=1000, seed=1)
  src = ts.TopicSource(p)
  doc = src.tokens(ts.TRAIN, 7)
  assert doc.shape == (1000,) and doc.min() >= 0 and doc.max() < 32
  # the model view starts every document with BOS (id = vocab_size), never inside one
  view = src.sequence(ts.TRAIN, 7, 0, 1001)
  assert view[0] == p.bos_id == 32 and np.array_equal(view[1:], doc)
  assert not np.any(doc == p.bos_id)
  # windows of any length tile the same document (content independent of windowing, across blocks)
  for seq_len in (64, 100, 333):
    k = 2
    w = src.window(ts.TRAIN, 7, k, seq_len)
    np.testing.assert_array_equal(w["targets"], doc[k * seq_len : (k + 1) * seq_len])
    np.testing.assert_array_equal(w["inputs"][1:], doc[k * seq_len : (k + 1) * seq_len - 1])
    np.testing.assert_array_equal(w["inputs"][0], doc[k * seq_len - 1])
  first = src.window(ts.TRAIN, 7, 0, 64)
  assert first["inputs"][0] == p.bos_id
  np.testing.assert_array_equal(src.tokens(ts.TRAIN, 7, 250, 270), doc[250:270])
  # splits and documents differ
  assert not np.array_equal(doc, src.tokens(ts.EVAL, 7))
  assert not np.array_equal(doc, src.tokens(ts.TRAIN, 8))
  with pytest.raises(ValueError, match="outside the document"):
    src.tokens(ts.TRAIN, 7, 990, 1001)


def test_deterministic_from_seed():
  p = ts.TopicParams(vocab_size=64, num_topics=5, switch_prob=0.01, doc_len=3000, seed=11)
  a, b = ts.TopicSource(p), ts.TopicSource(p)
  np.testing.assert_array_equal(a.perms, b.perms)
  np.testing.assert_array_equal(a.tokens(ts.TRAIN, 3), b.tokens(ts.TRAIN, 3))
  for x, y in zip(a.topic_path(ts.TRAIN, 3), b.topic_path(ts.TRAIN, 3)):
    np.testing.assert_array_equal(x, y)
  c = ts.TopicSource(
    ts.TopicParams(vocab_size=64, num_topics=5, switch_prob=0.01, doc_len=3000, seed=12)
  )
  assert not np.array_equal(a.perms, c.perms)
  assert not np.array_equal(a.tokens(ts.TRAIN, 3), c.tokens(ts.TRAIN, 3))


def test_sampling_statistics_match_the_parameters():
  z, p_switch, n_docs, length = 6, 0.02, 300, 2000
  src = ts.TopicSource(
    ts.TopicParams(
      vocab_size=50, num_topics=z, zipf_exponent=1.1, switch_prob=p_switch, doc_len=length, seed=2
    )
  )
  topics = np.stack([src.topics(ts.TRAIN, d) for d in range(n_docs)])
  switched = topics[:, 1:] != topics[:, :-1]
  n = switched.size
  # switch rate: binomial(n, p), within 4 standard deviations
  assert abs(switched.sum() - n * p_switch) < 4 * np.sqrt(n * p_switch * (1 - p_switch))
  # first topics uniform (chi-square with z - 1 = 5 dof; 20.5 is its 0.999 quantile)
  counts = np.bincount(topics[:, 0], minlength=z)
  assert ((counts - n_docs / z) ** 2 / (n_docs / z)).sum() < 20.5
  # a switch moves to one of the other topics, uniformly: offsets 1..z-1 equally likely
  offsets = ((topics[:, 1:] - topics[:, :-1]) % z)[switched]
  assert offsets.min() >= 1
  oc = np.bincount(offsets, minlength=z)[1:]
  assert ((oc - len(offsets) / (z - 1)) ** 2 / (len(offsets) / (z - 1))).sum() < 18.5
  # tokens given topic follow the topic's Zipf law over its permutation
  toks = np.stack([src.tokens(ts.TRAIN, d) for d in range(n_docs)])
  rank_of = np.argsort(src.perms, axis=1)  # [Z, V] token -> rank
  ranks = rank_of[topics, toks]
  freq = np.bincount(ranks.ravel(), minlength=50) / ranks.size
  assert 0.5 * np.abs(freq - src.rank_probs).sum() < 0.01  # total variation
  # the empirical NLL of the true topic's law is the Zipf entropy; the floor is above it, by little
  entropy = -(src.rank_probs * np.log(src.rank_probs)).sum()
  floor = src.bayes_nll(toks[:50])
  assert entropy < floor[:, 200:].mean() < entropy + 0.2
  assert floor[:, 0].mean() > floor[:, 200:].mean()  # nothing known at the start


def test_bad_parameters_name_the_argument():
  for word, value in (
    ("num_topics", 1),
    ("switch_prob", 1.5),
    ("doc_len", 0),
    ("vocab_size", 1),
    ("zipf_exponent", -1.0),
  ):
    with pytest.raises(ValueError, match=f"topic source.{word}: must"):
      ts.TopicSource(ts.TopicParams(**{word: value}))


def _dirichlet_source(**kw):
  params = dict(family="dirichlet", vocab_size=5, concentration=0.3, doc_len=400, seed=4)
  return ts.TopicSource(ts.TopicParams(**(params | kw)))


def test_dirichlet_floor_is_the_dirichlet_multinomial_predictive():
  """The chain of predictives multiplies to the closed-form Dirichlet-multinomial probability of
  the whole sequence, and each predictive sums to one over the next token."""
  gammaln = np.vectorize(math.lgamma)
  src = _dirichlet_source()
  v, a = 5, 0.3
  docs = np.stack([src.tokens(ts.EVAL, d, 0, 50) for d in range(6)])
  nll = src.bayes_nll(docs)
  for row, got in zip(docs, nll):
    counts = np.bincount(row, minlength=v)
    log_p = gammaln(v * a) - gammaln(len(row) + v * a) + np.sum(gammaln(counts + a) - gammaln(a))
    np.testing.assert_allclose(-got.sum(), log_p, rtol=1e-12)
  for t in (0, 7, 49):  # every continuation of a prefix: the predictive sums to one
    prefix = docs[0, :t]
    rows = np.stack([np.concatenate([prefix, [x]]) for x in range(v)])
    np.testing.assert_allclose(np.exp(-src.bayes_nll(rows)[:, t]).sum(), 1.0, rtol=1e-12)


def test_dirichlet_documents_follow_their_own_law():
  """Tokens are i.i.d. from the document's own law, windows are cut from the same document, and the
  floor's predictive scores better than a mis-specified concentration (it is the Bayes optimum)."""
  src = _dirichlet_source(vocab_size=8, doc_len=40000)
  law = src.doc_laws(ts.TRAIN, [3])[0]
  freq = np.bincount(src.tokens(ts.TRAIN, 3), minlength=8) / 40000
  np.testing.assert_allclose(freq, law, atol=0.01)
  w = src.window(ts.TRAIN, 3, 2, 64)
  np.testing.assert_array_equal(w["inputs"], src.tokens(ts.TRAIN, 3, 127, 191))
  docs = np.stack([src.tokens(ts.EVAL, d, 0, 64) for d in range(400)])
  true = src.bayes_nll(docs).mean()
  for wrong in (0.05, 2.0):
    assert true < ts.dirichlet_nll(docs, 8, wrong).mean()
  with pytest.raises(ValueError, match="topic paths exist only in the hmm family"):
    src.topic_path(ts.TRAIN, 3)
  with pytest.raises(ValueError, match="family"):
    ts.TopicParams(family="lda").check()
  with pytest.raises(ValueError, match="concentration"):
    ts.TopicParams(family="dirichlet", concentration=0.0).check()
