"""A stationary slow-switching topic source with an exact Bayes floor (a hidden Markov model).

The world: ``num_topics`` topics, each a Zipf distribution (rank r has weight
``(r + 1) ** -zipf_exponent``) over its own random permutation of the vocabulary. A document of
``doc_len`` tokens starts in a topic drawn uniformly; after every token the topic switches with
probability ``switch_prob`` to one of the OTHER topics, uniformly (so ``switch_prob`` is exactly the
per-token switch rate). Tokens are drawn from the current topic's distribution.

The optimal predictor needs the posterior over the current topic given the whole history (unbounded
memory), and its loss is the floor every model's NLL is compared with: :func:`bayes_nll`, the HMM
forward algorithm in float64, normalised at every step.

Everything is deterministic from ``seed``: the world (topic permutations) from ``seed`` alone, and
every random draw of document ``d`` of split ``s`` is a counter-based hash of
``(seed, stream, s, d, index)`` (:func:`uniform`), so any window of any document is computed
directly, in O(window + switches), and a batch of windows from many documents in one vectorised
pass. A document's topic path is its switch positions (geometric gaps by inverse CDF) and new
topics; its token at position t uses the uniform of index t. A document's content therefore does
not depend on how it is cut into windows.

A second family, ``family='dirichlet'``, gives every document its own unigram law: theta_d ~
Dirichlet(``concentration``) over the vocabulary, tokens i.i.d. from theta_d. Its Bayes predictive
is closed-form, ``(n_v(x_{<t}) + a) / (t + V a)``, and keeps improving at every length (the excess
of a predictor that stops counting after T tokens is about (V - 1) / 2 * (1/T - 1/t) nats per token
at position t), so the optimum needs a state that counts without bound: a model trained at a short
length must run its state past the range it was trained on to keep up. ``num_topics``,
``zipf_exponent`` and ``switch_prob`` do not apply to it.

Model view: the token id ``vocab_size`` is BOS; a document is read as ``[BOS, x_0, ..., x_{L-1}]``,
so the target at position ``t`` (0-based) is ``x_t`` predicted from ``x_{<t}``, and its floor is
``-log p(x_t | x_{<t})``.
"""

from __future__ import annotations

import numpy as np

from experiments.schema import FAMILIES, TopicParams, params_from_config  # noqa: F401 (this source's parameters)

TRAIN, VALID, EVAL = (
  0,
  1,
  2,
)  # document splits: training windows, validation windows, floor evaluation
_WORLD, _GAPS, _FIRST, _MOVES, _TOKENS, _THETA = 0, 1, 2, 3, 4, 5  # random stream tags
_FILTER_BLOCK = 2048


def zipf_weights(vocab_size: int, exponent: float) -> np.ndarray:
  """Probabilities of ranks 0 .. vocab_size - 1 (float64, sum 1)."""
  w = np.arange(1, vocab_size + 1, dtype=np.float64) ** -float(exponent)
  return w / w.sum()


_M1, _M2, _GOLDEN = (
  np.uint64(0xBF58476D1CE4E5B9),
  np.uint64(0x94D049BB133111EB),
  np.uint64(0x9E3779B97F4A7C15),
)


def _mix(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser: a bijective avalanche of uint64 (wrapping arithmetic)."""
  z = x + _GOLDEN
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


def _key(*parts) -> np.ndarray:
  """A uint64 key (array-valued where a part is an array) from integer parts, chained through
  _mix."""
  h = np.uint64(0)
  with np.errstate(over="ignore"):
    for p in parts:
      h = _mix(np.asarray(h, np.uint64) ^ np.asarray(p).astype(np.uint64))
  return h


def uniform(key: np.ndarray, index: np.ndarray) -> np.ndarray:
  """Uniforms in [0, 1) (float64, 53 random bits) of ``(key, index)``, broadcast."""
  with np.errstate(over="ignore"):
    h = _mix(np.asarray(key, np.uint64) ^ _mix(np.asarray(index).astype(np.uint64)))
  return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


class TopicSource:
  """The world (topic permutations, emission table) and lazily generated documents."""

  def __init__(self, params: TopicParams):
    params.check()
    self.params = p = params
    rng = np.random.default_rng([p.seed, _WORLD])
    self.perms = np.stack(
      [rng.permutation(p.vocab_size) for _ in range(p.num_topics)]
    )  # [Z, V] rank->token
    self.rank_probs = zipf_weights(p.vocab_size, p.zipf_exponent)
    self._cdf = np.cumsum(self.rank_probs)
    self._cdf[-1] = 1.0
    emit = np.zeros((p.num_topics, p.vocab_size), np.float64)
    np.put_along_axis(emit, self.perms, np.broadcast_to(self.rank_probs, emit.shape), axis=1)
    self.emissions = emit  # [Z, V]: p(token | topic)

  # ---------------------------------------------------------------------------------- documents
  def _doc_keys(self, split, docs, stream):
    return _key(self.params.seed, stream, split, np.asarray(docs, np.int64))

  def topic_paths(self, split: int, docs) -> tuple[np.ndarray, np.ndarray]:
    """(starts, topics) [len(docs), K]: segment k of a document has topic ``topics[:, k]`` from
    position ``starts[:, k]`` (``starts[:, 0] = 0``; columns past the document's end start at or
    after doc_len)."""
    p, docs = self.params, np.atleast_1d(np.asarray(docs, np.int64))
    if p.family != "hmm":
      raise ValueError(
        f"topic source: topic paths exist only in the hmm family (family={p.family!r}: each "
        "document has its own law, doc_laws)"
      )
    n = len(docs)
    first = np.floor(uniform(self._doc_keys(split, docs, _FIRST), 0) * p.num_topics).astype(
      np.int64
    )
    if p.switch_prob == 0:
      return np.zeros((n, 1), np.int64), first[:, None]
    gkey = self._doc_keys(split, docs, _GAPS)[:, None]
    per = int(p.doc_len * p.switch_prob * 1.5) + 16
    log_stay = np.log1p(-p.switch_prob) if p.switch_prob < 1 else -np.inf
    starts = np.zeros((n, 1), np.int64)
    while starts[:, -1].min() < p.doc_len:  # gap ~ Geometric(p) on {1, 2, ...} by inverse CDF
      j = np.arange(starts.shape[1] - 1, starts.shape[1] - 1 + per)
      u = 1.0 - uniform(gkey, j[None, :])  # in (0, 1]
      with np.errstate(divide="ignore", invalid="ignore"):
        gaps = np.floor(np.log(u) / log_stay) + 1 if np.isfinite(log_stay) else np.ones_like(u)
      gaps = np.minimum(np.nan_to_num(gaps, nan=1.0), p.doc_len).astype(np.int64)
      starts = np.concatenate([starts, starts[:, -1:] + np.cumsum(gaps, axis=1)], axis=1)
    k = starts.shape[1]
    moves = 1 + np.floor(
      uniform(self._doc_keys(split, docs, _MOVES)[:, None], np.arange(k - 1)[None, :])
      * (p.num_topics - 1)
    ).astype(np.int64)  # an offset in 1..Z-1: another topic
    topics = (
      first[:, None]
      + np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(moves, axis=1)], axis=1)
    ) % p.num_topics
    return starts, topics

  def topic_path(self, split: int, doc: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, topics) of one document's segments inside it."""
    starts, topics = self.topic_paths(split, [doc])
    keep = starts[0] < self.params.doc_len
    return starts[0][keep], topics[0][keep]

  def _check_range(self, start, stop):
    p = self.params
    if np.any(start < 0) or np.any(stop > p.doc_len) or np.any(start > stop):
      raise ValueError(
        f"topic source: token range [{start}, {stop}) outside the document [0, {p.doc_len})"
      )

  def _topics_at(self, split: int, docs: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """[B, L]: the topic of document ``docs[b]`` at positions ``pos[b]`` (inside the document)."""
    seg_starts, seg_topics = self.topic_paths(split, docs)
    n = seg_starts.shape[0]
    # one searchsorted over all rows: row b's segment starts shifted by b * 2^40 (rows never
    # interleave)
    off = np.arange(n, dtype=np.int64)[:, None] * np.int64(2**40)
    col = np.searchsorted((seg_starts + off).ravel(), (pos + off).ravel(), side="right") - 1
    return seg_topics.ravel()[col].reshape(pos.shape)

  def _tokens_at(self, split: int, docs: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """[B, L] int32: the tokens of document ``docs[b]`` at positions ``pos[b]`` (inside the
    document)."""
    u = uniform(self._doc_keys(split, docs, _TOKENS)[:, None], pos)
    if self.params.family == "dirichlet":
      cdf = np.cumsum(self.doc_laws(split, docs), axis=1)  # [B, V]
      cdf[:, -1] = 1.0
      tok = np.stack([np.searchsorted(c, row, side="right") for c, row in zip(cdf, u)])
      return np.minimum(tok, self.params.vocab_size - 1).astype(np.int32)
    ranks = np.minimum(np.searchsorted(self._cdf, u, side="right"), self.params.vocab_size - 1)
    return self.perms[self._topics_at(split, docs, pos), ranks].astype(np.int32)

  def doc_laws(self, split: int, docs) -> np.ndarray:
    """[len(docs), V] float64: each document's own unigram law theta_d ~ Dirichlet(concentration)
    (the ``dirichlet`` family), drawn from a generator seeded by (seed, split, doc)."""
    p = self.params
    if p.family != "dirichlet":
      raise ValueError(
        f"topic source: documents have their own laws only in the dirichlet family "
        f"(family={p.family!r})"
      )
    alpha = np.full(p.vocab_size, p.concentration)
    rows = []
    for d in np.atleast_1d(np.asarray(docs, np.int64)):
      rng = np.random.default_rng([p.seed, _THETA, int(split), int(d)])
      g = rng.standard_gamma(alpha)
      if g.sum() == 0:  # every gamma draw underflowed (tiny concentration): one token type
        g[rng.integers(p.vocab_size)] = 1.0
      rows.append(g / g.sum())
    return np.stack(rows)

  def _positions(self, starts, length):
    starts = np.atleast_1d(starts).astype(np.int64)
    self._check_range(starts, starts + length)
    return starts[:, None] + np.arange(length)[None, :]

  def batch_topics(self, split: int, docs, starts, length: int) -> np.ndarray:
    """[B, length]: the topic at positions ``starts[b] .. starts[b] + length - 1`` of document
    ``docs[b]``."""
    return self._topics_at(
      split, np.atleast_1d(docs).astype(np.int64), self._positions(starts, length)
    )

  def batch_tokens(self, split: int, docs, starts, length: int) -> np.ndarray:
    """[B, length] int32: tokens ``x[starts[b] : starts[b] + length]`` of document ``docs[b]``."""
    return self._tokens_at(
      split, np.atleast_1d(docs).astype(np.int64), self._positions(starts, length)
    )

  def topics(self, split: int, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The topic at each position ``start .. stop - 1`` of a document."""
    stop = self.params.doc_len if stop is None else stop
    self._check_range(start, stop)
    return self.batch_topics(split, [doc], [start], stop - start)[0]

  def tokens(self, split: int, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens ``x[start:stop]`` of a document (int32)."""
    stop = self.params.doc_len if stop is None else stop
    self._check_range(start, stop)
    return self.batch_tokens(split, [doc], [start], stop - start)[0]

  def windows(self, split: int, docs, ks, seq_len: int) -> dict:
    """Training windows [B, seq_len]: row b is window ``ks[b]`` of document ``docs[b]`` in the model
    view ``[BOS, x_0, ..., x_{L-1}]`` (its targets are positions ``k * seq_len .. (k + 1) * seq_len
    - 1``)."""
    docs, ks = np.atleast_1d(docs).astype(np.int64), np.atleast_1d(ks).astype(np.int64)
    if np.any(ks < 0) or np.any((ks + 1) * seq_len > self.params.doc_len):
      raise ValueError(
        f"topic source: window index outside [0, {self.windows_per_doc(seq_len)}) for "
        f"seq_len={seq_len}"
      )
    # view entry e holds x_{e-1} (entry 0 is BOS): window k is entries k*T .. k*T + T
    pos = ks[:, None] * seq_len - 1 + np.arange(seq_len + 1)[None, :]
    w = self._tokens_at(split, docs, np.maximum(pos, 0))
    w[pos < 0] = self.params.bos_id
    return {"inputs": w[:, :-1], "targets": w[:, 1:], "mask": np.ones(w[:, 1:].shape, np.float32)}

  def window(self, split: int, doc: int, k: int, seq_len: int) -> dict:
    """The k-th training window of a document (one row of :meth:`windows`)."""
    return {key: v[0] for key, v in self.windows(split, [doc], [k], seq_len).items()}

  def sequence(self, split: int, doc: int, start: int, length: int) -> np.ndarray:
    """Entries ``start .. start + length - 1`` of the model view ``[BOS, x_0, ..., x_{L-1}]``
    (int32)."""
    p = self.params
    if start < 0 or start + length > p.doc_len + 1:
      raise ValueError(
        f"topic source: window [{start}, {start + length}) outside the document view "
        f"[0, {p.doc_len + 1})"
      )
    if start == 0:
      return np.concatenate([[p.bos_id], self.tokens(split, doc, 0, length - 1)]).astype(np.int32)
    return self.tokens(split, doc, start - 1, start - 1 + length)

  def windows_per_doc(self, seq_len: int) -> int:
    return self.params.doc_len // seq_len

  # ---------------------------------------------------------------------------------- the floor
  def bayes_nll(self, tokens: np.ndarray) -> np.ndarray:
    """Exact ``-log p(x_t | x_{<t})`` [N, L] (float64) of documents ``tokens`` [N, L] read from
    their start."""
    p = self.params
    if p.family == "dirichlet":
      return dirichlet_nll(tokens, p.vocab_size, p.concentration)
    return bayes_nll(tokens, self.emissions, p.switch_prob)


def dirichlet_nll(tokens: np.ndarray, vocab_size: int, concentration: float) -> np.ndarray:
  """The Dirichlet-multinomial predictive's ``-log p(x_t | x_{<t})`` [N, L]: ``(n + a) / (t + V a)``
  with n the count of x_t among the t tokens before it."""
  tokens = np.atleast_2d(np.asarray(tokens, np.int64))
  n, length = tokens.shape
  # the count of x_t before t: its rank among the equal tokens of its row (a stable sort by token)
  order = np.argsort(tokens, axis=1, kind="stable")
  sorted_tok = np.take_along_axis(tokens, order, axis=1)
  idx = np.arange(length)[None, :]
  first = np.where(
    np.concatenate([np.ones((n, 1), bool), sorted_tok[:, 1:] != sorted_tok[:, :-1]], axis=1), idx, 0
  )
  rank_sorted = idx - np.maximum.accumulate(first, axis=1)
  before = np.empty_like(rank_sorted)
  np.put_along_axis(before, order, rank_sorted, axis=1)
  t = np.arange(length, dtype=np.float64)[None, :]
  return -np.log((before + concentration) / (t + vocab_size * concentration))


def bayes_nll(tokens: np.ndarray, emissions: np.ndarray, switch_prob: float) -> np.ndarray:
  """HMM forward algorithm: ``-log p(x_t | x_{<t})`` [N, L] for documents ``tokens`` [N, L].

  The prior over the first topic is uniform; after each token the topic stays with probability
  ``1 - switch_prob`` and moves to each other topic with ``switch_prob / (Z - 1)``. The predictive
  distribution over topics is renormalised at every step (float64), so no log-space sums are needed.
  """
  tokens = np.atleast_2d(np.asarray(tokens))
  z = emissions.shape[0]
  n, length = tokens.shape
  q = switch_prob / (z - 1)
  stay = 1.0 - switch_prob - q  # pred' = post * (1 - p) + (1 - post) * q = post * stay + q
  pred = np.full((n, z), 1.0 / z)
  out = np.empty((n, length), np.float64)
  for a in range(0, length, _FILTER_BLOCK):  # bounds the [N, block, Z] likelihood table
    lik = np.moveaxis(emissions[:, tokens[:, a : a + _FILTER_BLOCK]], 0, -1)  # p(x_t | topic)
    for i in range(lik.shape[1]):
      joint = pred * lik[:, i]
      c = joint.sum(axis=1)
      out[:, a + i] = -np.log(c)
      pred = joint * (stay / c)[:, None] + q
  return out
