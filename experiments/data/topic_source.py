"""A stationary slow-switching topic source with an exact Bayes floor (a hidden Markov model).

The world: ``num_topics`` topics, each a Zipf distribution (rank r has weight ``(r + 1) ** -zipf_exponent``)
over its own random permutation of the vocabulary ``0 .. vocab_size - 1``. A document of ``doc_len`` tokens
starts in a topic drawn uniformly; after every token the topic switches with probability ``switch_prob`` to
one of the OTHER topics, uniformly (so ``switch_prob`` is exactly the per-token switch rate). Tokens are
drawn from the current topic's distribution.

The optimal predictor needs the posterior over the current topic given the whole history (unbounded
memory), and its loss is the floor every model's NLL is compared with: :func:`bayes_nll`, the HMM
forward algorithm in float64, normalised at every step.

Everything is deterministic from ``seed``: the world (topic permutations) from ``seed`` alone, document
``d`` of split ``s`` from ``(seed, s, d)``. A document is laid out lazily so that any window of it costs
O(window + switches): its topic path (switch positions from geometric gaps, new topics) is one small draw,
and its tokens come in blocks of :data:`BLOCK` positions, block ``b`` drawn from ``(seed, s, d, b)``; a
document's content therefore does not depend on how it is cut into windows.

Model view: the token id ``vocab_size`` is BOS; a document is read as ``[BOS, x_0, ..., x_{L-1}]``, so the
target at position ``t`` (0-based) is ``x_t`` predicted from ``x_{<t}``, and its floor is
``-log p(x_t | x_{<t})``.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

BLOCK = 256            # tokens drawn per RNG stream (a document's content is independent of windowing)
TRAIN, VALID, EVAL = 0, 1, 2   # document splits: training windows, validation windows, floor evaluation
_WORLD, _PATH, _TOKENS = 0, 1, 2   # RNG stream tags
_FILTER_BLOCK = 2048


@dataclasses.dataclass(frozen=True)
class TopicParams:
  vocab_size: int = 512
  num_topics: int = 16
  zipf_exponent: float = 1.1
  switch_prob: float = 1.0 / 2048
  doc_len: int = 65536
  seed: int = 0

  def check(self, where: str = 'topic source') -> None:
    """Raises ValueError naming the first bad parameter as ``<where>.<name>``."""
    rules = (('vocab_size', self.vocab_size >= 2, 'must be >= 2'),
             ('num_topics', self.num_topics >= 2, 'must be >= 2 (a switch moves to another topic)'),
             ('zipf_exponent', self.zipf_exponent >= 0, 'must be >= 0'),
             ('switch_prob', 0.0 <= self.switch_prob <= 1.0, 'must be in [0, 1]'),
             ('doc_len', self.doc_len >= 1, 'must be positive'))
    for name, ok, expected in rules:
      if not ok:
        raise ValueError(f'{where}.{name}: {expected}, got {getattr(self, name)!r}')

  @property
  def bos_id(self) -> int:
    return self.vocab_size

  @property
  def model_vocab(self) -> int:
    """Token ids a model must cover: the vocabulary and BOS."""
    return self.vocab_size + 1


def params_from_config(cfg) -> TopicParams:
  """TopicParams from a run config's ``data.topic`` section."""
  return TopicParams(vocab_size=int(cfg.vocab_size), num_topics=int(cfg.num_topics),
                     zipf_exponent=float(cfg.zipf_exponent), switch_prob=float(cfg.switch_prob),
                     doc_len=int(cfg.doc_len), seed=int(cfg.seed))


def zipf_weights(vocab_size: int, exponent: float) -> np.ndarray:
  """Probabilities of ranks 0 .. vocab_size - 1 (float64, sum 1)."""
  w = np.arange(1, vocab_size + 1, dtype=np.float64) ** -float(exponent)
  return w / w.sum()


class TopicSource:
  """The world (topic permutations, emission table) and lazily generated documents."""

  def __init__(self, params: TopicParams):
    params.check()
    self.params = p = params
    rng = np.random.default_rng([p.seed, _WORLD])
    self.perms = np.stack([rng.permutation(p.vocab_size) for _ in range(p.num_topics)])  # [Z, V] rank->token
    self.rank_probs = zipf_weights(p.vocab_size, p.zipf_exponent)
    self._cdf = np.cumsum(self.rank_probs)
    self._cdf[-1] = 1.0
    emit = np.zeros((p.num_topics, p.vocab_size), np.float64)
    np.put_along_axis(emit, self.perms, np.broadcast_to(self.rank_probs, emit.shape), axis=1)
    self.emissions = emit   # [Z, V]: p(token | topic)
    self._path = functools.lru_cache(maxsize=4096)(self._topic_path)

  # ---------------------------------------------------------------------------------- documents
  def _topic_path(self, split: int, doc: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts [K], topics [K]): segment k has topic ``topics[k]`` from position ``starts[k]`` (starts[0]=0)."""
    p = self.params
    rng = np.random.default_rng([p.seed, _PATH, split, doc])
    first = int(rng.integers(p.num_topics))
    starts = np.zeros((1,), np.int64)
    if p.switch_prob > 0:   # gaps ~ Geometric(p) on {1, 2, ...}: a topic lasts g tokens w.p. (1-p)^(g-1) p
      draw = int(p.doc_len * p.switch_prob * 1.5) + 16
      while starts[-1] < p.doc_len:
        starts = np.concatenate([starts, starts[-1] + np.cumsum(rng.geometric(p.switch_prob, size=draw))])
      starts = starts[starts < p.doc_len]
    moves = rng.integers(1, p.num_topics, size=len(starts) - 1)   # an offset in 1..Z-1: another topic
    topics = np.concatenate([[first], (first + np.cumsum(moves)) % p.num_topics]).astype(np.int64)
    return np.asarray(starts, np.int64), topics

  def topic_path(self, split: int, doc: int) -> tuple[np.ndarray, np.ndarray]:
    return self._path(int(split), int(doc))

  def topics(self, split: int, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The topic at each position ``start .. stop - 1`` of a document."""
    stop = self.params.doc_len if stop is None else stop
    starts, topics = self.topic_path(split, doc)
    pos = np.arange(start, stop)
    return topics[np.searchsorted(starts, pos, side='right') - 1]

  def tokens(self, split: int, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens ``x[start:stop]`` of a document (int32)."""
    p = self.params
    stop = p.doc_len if stop is None else stop
    if not 0 <= start <= stop <= p.doc_len:
      raise ValueError(f'topic source: token range [{start}, {stop}) outside the document [0, {p.doc_len})')
    if start == stop:
      return np.zeros((0,), np.int32)
    b0, b1 = start // BLOCK, (stop - 1) // BLOCK + 1
    u = np.concatenate([np.random.default_rng([p.seed, _TOKENS, split, doc, b]).random(BLOCK)
                        for b in range(b0, b1)])[start - b0 * BLOCK: stop - b0 * BLOCK]
    ranks = np.minimum(np.searchsorted(self._cdf, u, side='right'), p.vocab_size - 1)
    return self.perms[self.topics(split, doc, start, stop), ranks].astype(np.int32)

  def sequence(self, split: int, doc: int, start: int, length: int) -> np.ndarray:
    """Entries ``start .. start + length - 1`` of the model view ``[BOS, x_0, ..., x_{L-1}]`` (int32)."""
    p = self.params
    if start < 0 or start + length > p.doc_len + 1:
      raise ValueError(f'topic source: window [{start}, {start + length}) outside the document view '
                       f'[0, {p.doc_len + 1})')
    if start == 0:
      return np.concatenate([[p.bos_id], self.tokens(split, doc, 0, length - 1)]).astype(np.int32)
    return self.tokens(split, doc, start - 1, start - 1 + length)

  def window(self, split: int, doc: int, k: int, seq_len: int) -> dict:
    """The k-th training window of a document: inputs/targets of ``seq_len`` positions (targets are
    positions ``k * seq_len .. (k + 1) * seq_len - 1`` of the document)."""
    w = self.sequence(split, doc, k * seq_len, seq_len + 1)
    return {'inputs': w[:-1], 'targets': w[1:], 'mask': np.ones(seq_len, np.float32)}

  def windows_per_doc(self, seq_len: int) -> int:
    return self.params.doc_len // seq_len

  # ---------------------------------------------------------------------------------- the floor
  def bayes_nll(self, tokens: np.ndarray) -> np.ndarray:
    """Exact ``-log p(x_t | x_{<t})`` [N, L] (float64) of documents ``tokens`` [N, L] read from their start."""
    return bayes_nll(tokens, self.emissions, self.params.switch_prob)


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
  stay = 1.0 - switch_prob - q       # pred' = post * (1 - p) + (1 - post) * q = post * stay + q
  pred = np.full((n, z), 1.0 / z)
  out = np.empty((n, length), np.float64)
  for a in range(0, length, _FILTER_BLOCK):   # bounds the [N, block, Z] likelihood table
    lik = np.moveaxis(emissions[:, tokens[:, a:a + _FILTER_BLOCK]], 0, -1)    # p(x_t | topic)
    for i in range(lik.shape[1]):
      joint = pred * lik[:, i]
      c = joint.sum(axis=1)
      out[:, a + i] = -np.log(c)
      pred = joint * (stay / c)[:, None] + q
  return out
