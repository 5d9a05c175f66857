"""Percentile bootstrap intervals over independent units (evaluation documents, windows, seeds).

Every statistic here is a function of per-unit values: a mean, a ratio of two means, a paired
difference of means. A resample draws the units with replacement (the same draw for every column and
for both halves of a ratio or difference, so their dependence is kept); the interval is the ``(1 -
level) / 2`` and ``(1 + level) / 2`` percentiles of the statistic over the resamples. Deterministic
from ``seed``.

Units are rows: ``x`` is [N] or [N, K] (K statistics at once, e.g. one per position bucket).

The ``*_crossed`` forms take a two-way table instead, ``x`` [S, N] of seeds x test examples where
every seed was measured on the same examples: a resample draws S seeds and N examples independently,
each with replacement, and averages the table over both draws. Both sources of variation (which models
training produced, which examples were drawn) then widen the interval; with few seeds the seed draw is
coarse (3 seeds give 10 distinct multisets), which the interval shows as it is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000


@dataclasses.dataclass(frozen=True)
class Interval:
  estimate: np.ndarray | float  # the statistic on the units as they are
  lo: np.ndarray | float
  hi: np.ndarray | float
  level: float
  resamples: int
  units: int

  def to_json(self) -> dict:
    def conv(v):
      return v.tolist() if isinstance(v, np.ndarray) else float(v)

    return {
      "estimate": conv(self.estimate),
      "lo": conv(self.lo),
      "hi": conv(self.hi),
      "level": self.level,
      "resamples": self.resamples,
      "units": self.units,
    }


def resample_counts(units: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
  """[resamples, units] how often each unit is drawn (each row sums to ``units``)."""
  if units < 1:
    raise ValueError(f"bootstrap: needs at least one unit, got {units}")
  if resamples < 1:
    raise ValueError(f"bootstrap: resamples must be positive, got {resamples}")
  draws = np.random.default_rng(seed).integers(0, units, size=(resamples, units))
  flat = (draws + units * np.arange(resamples)[:, None]).ravel()
  return np.bincount(flat, minlength=resamples * units).reshape(resamples, units).astype(np.float64)


def _rows(x, name: str) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim not in (1, 2):
    raise ValueError(f"bootstrap: {name} must be [units] or [units, K], got shape {x.shape}")
  return x


def _interval(estimate, draws, level, units) -> Interval:
  if not 0 < level < 1:
    raise ValueError(f"bootstrap: level must be in (0, 1), got {level}")
  # no interpolation between order statistics: keeps infinite draws (a ratio over a non-positive
  # denominator) from turning into nan
  lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0, method="inverted_cdf")
  if np.ndim(estimate) == 0:
    estimate, lo, hi = float(estimate), float(lo), float(hi)
  return Interval(estimate, lo, hi, level, len(draws), units)


def _means(x, counts):
  """[R] or [R, K] resampled means of the rows of x."""
  return counts @ x / x.shape[0]


def mean(x, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
  """The mean over units (per column)."""
  x = _rows(x, "x")
  counts = resample_counts(x.shape[0], resamples, seed)
  return _interval(x.mean(axis=0), _means(x, counts), level, x.shape[0])


def ratio_of_means(
  num, den, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
  """``mean(num) / mean(den)`` with the units drawn jointly (paired). A resample whose denominator
  mean is not positive gives +inf (or nan for 0/0), so a denominator near zero shows as an unbounded
  interval."""
  num, den = _rows(num, "num"), _rows(den, "den")
  if num.shape[0] != den.shape[0]:
    raise ValueError(
      f"bootstrap: num and den need the same units, got {num.shape[0]} and {den.shape[0]}"
    )
  counts = resample_counts(num.shape[0], resamples, seed)
  with np.errstate(divide="ignore", invalid="ignore"):
    est = _safe_ratio(num.mean(axis=0), den.mean(axis=0))
    draws = _safe_ratio(_means(num, counts), _means(den, counts))
  return _interval(est, draws, level, num.shape[0])


def of_means(fn, *xs, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
  """``fn(mean(x_1), ..., mean(x_k))``: a statistic of the column means of tables over the same
  units, drawn jointly (paired). Each ``x_i`` is [N] or [N, K_i]; ``fn`` maps column means (with a
  leading resample axis in the draws) to the statistic, so a choice it makes among columns (a
  minimum, say) is made again in every resample."""
  xs = [_rows(x, f"x{i}") for i, x in enumerate(xs)]
  if len({x.shape[0] for x in xs}) != 1:
    raise ValueError(f"bootstrap: the tables need the same units, got {[x.shape[0] for x in xs]}")
  counts = resample_counts(xs[0].shape[0], resamples, seed)
  est = fn(*[x.mean(axis=0) for x in xs])
  draws = fn(*[_means(x, counts) for x in xs])
  return _interval(est, draws, level, xs[0].shape[0])


def _safe_ratio(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.where(a == 0, np.nan, np.inf * np.sign(a)))


def paired_difference(
  a, b, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
  """``mean(a - b)`` over units measured under both conditions."""
  a, b = _rows(a, "a"), _rows(b, "b")
  if a.shape != b.shape:
    raise ValueError(f"bootstrap: paired values need the same shape, got {a.shape} and {b.shape}")
  return mean(a - b, level=level, resamples=resamples, seed=seed)


def unpaired_difference(
  a, b, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
  """``mean(a) - mean(b)`` over units measured under one condition each (other examples): the units
  of ``a`` and of ``b`` are drawn independently. ``units`` is (len(a), len(b))."""
  a, b = _rows(a, "a"), _rows(b, "b")
  if a.shape[1:] != b.shape[1:]:
    raise ValueError(f"bootstrap: a and b need the same columns, got {a.shape} and {b.shape}")
  seed_a, seed_b = np.random.default_rng(seed).integers(0, 2**32, size=2)
  draws = _means(a, resample_counts(a.shape[0], resamples, int(seed_a))) - _means(
    b, resample_counts(b.shape[0], resamples, int(seed_b))
  )
  return _interval(a.mean(axis=0) - b.mean(axis=0), draws, level, (a.shape[0], b.shape[0]))


def mean_crossed(x, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
  """The mean of a seeds x examples table ``x`` [S, N], seeds and examples resampled independently."""
  x = np.asarray(x, np.float64)
  if x.ndim != 2:
    raise ValueError(f"bootstrap: x must be [seeds, examples], got shape {x.shape}")
  s, n = x.shape
  seed_draws, example_draws = np.random.default_rng(seed).integers(0, 2**32, size=2)
  cs = resample_counts(s, resamples, int(seed_draws))
  ce = resample_counts(n, resamples, int(example_draws))
  draws = np.sum((cs @ x) * ce, axis=1) / (s * n)
  return _interval(x.mean(), draws, level, (s, n))


def paired_difference_crossed(
  a, b, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
  """``mean(a - b)`` of two seeds x examples tables: seed i of ``a`` paired with seed i of ``b`` and
  example j with example j, seeds and examples resampled independently (:func:`mean_crossed`)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"bootstrap: paired values need the same shape, got {a.shape} and {b.shape}")
  return mean_crossed(a - b, level=level, resamples=resamples, seed=seed)
