"""Percentile bootstrap intervals: coverage of a known mean / ratio at about the nominal rate,
determinism, paired resampling and argument errors."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.evaluation import bootstrap

REPS, UNITS = 400, 100


def _coverage(draw, stat, truth, **kw):
  hits = 0
  for r in range(REPS):
    iv = stat(*draw(np.random.default_rng(1000 + r)), seed=r, resamples=1000, **kw)
    hits += iv.lo <= truth <= iv.hi
  return hits / REPS


def test_mean_interval_covers_the_known_mean_at_the_nominal_rate():
  cov = _coverage(lambda rng: (rng.normal(2.0, 3.0, UNITS),), bootstrap.mean, 2.0)
  assert 0.92 <= cov <= 0.98, cov
  # a 50% interval covers about half the time: the level is used, not a fixed width
  cov50 = _coverage(lambda rng: (rng.normal(2.0, 3.0, UNITS),), bootstrap.mean, 2.0, level=0.5)
  assert 0.43 <= cov50 <= 0.57, cov50


def test_ratio_interval_covers_the_known_ratio():
  # per-unit pairs (num, den) with E[num] / E[den] = 3 and strongly correlated halves
  def draw(rng):
    den = rng.gamma(4.0, 0.5, UNITS)  # mean 2
    num = 3.0 * den + rng.normal(0.0, 1.0, UNITS)
    return num, den

  cov = _coverage(draw, bootstrap.ratio_of_means, 3.0)
  assert 0.92 <= cov <= 0.98, cov


def test_paired_resampling_keeps_the_pairing():
  rng = np.random.default_rng(0)
  base = rng.normal(0, 10, 60)  # large between-unit spread, shared by both conditions
  a, b = base + 1.0 + rng.normal(0, 0.1, 60), base
  paired = bootstrap.paired_difference(a, b, seed=1)
  assert paired.lo > 0.9 and paired.hi < 1.1
  # unpaired, the same data cannot tell the difference from zero
  unpaired = bootstrap.mean(a, seed=1).lo - bootstrap.mean(b, seed=2).hi
  assert unpaired < 0


def test_columns_deterministic_and_estimates():
  x = np.random.default_rng(1).exponential(1.0, (40, 3))
  iv = bootstrap.mean(x, seed=7)
  np.testing.assert_allclose(iv.estimate, x.mean(0))
  assert np.all(iv.lo < iv.estimate) and np.all(iv.estimate < iv.hi)
  again = bootstrap.mean(x, seed=7)
  np.testing.assert_array_equal(iv.lo, again.lo)
  assert not np.array_equal(iv.lo, bootstrap.mean(x, seed=8).lo)
  r = bootstrap.ratio_of_means(x[:, 0], x[:, 1], seed=3)
  assert r.estimate == pytest.approx(x[:, 0].mean() / x[:, 1].mean())
  assert r.to_json()["units"] == 40 and isinstance(r.to_json()["lo"], float)


def test_ratio_with_a_vanishing_denominator_is_unbounded():
  den = np.array([1.0, -1.0, 0.5, -0.6])
  r = bootstrap.ratio_of_means(np.ones(4), den, seed=0, resamples=500)
  assert r.hi == np.inf


def test_bad_arguments_name_them():
  with pytest.raises(ValueError, match="at least one unit"):
    bootstrap.mean(np.zeros(0))
  with pytest.raises(ValueError, match="level"):
    bootstrap.mean(np.ones(5), level=1.5)
  with pytest.raises(ValueError, match="same units"):
    bootstrap.ratio_of_means(np.ones(5), np.ones(4))
  with pytest.raises(ValueError, match="shape"):
    bootstrap.mean(np.ones((2, 2, 2)))


def test_crossed_paired_difference_matches_the_exact_seed_distribution():
  # Three seeds whose difference is -1, 0 and +1 on every example: a resample is the mean of three
  # seeds drawn with replacement; P(all three = -1) = 1/27 = 3.7% > 2.5%, so the 95% interval is
  # exactly [-1, 1], and an 80% one leaves out the 1/27 tails of each side: [-2/3, 2/3].
  a = np.repeat(np.array([[0.0], [1.0], [2.0]]), 50, axis=1)
  b = np.ones_like(a)
  iv = bootstrap.paired_difference_crossed(a, b, seed=3)
  assert (iv.estimate, iv.lo, iv.hi, iv.units) == (0.0, -1.0, 1.0, (3, 50))
  iv80 = bootstrap.paired_difference_crossed(a, b, level=0.8, seed=3)
  np.testing.assert_allclose([iv80.lo, iv80.hi], [-2 / 3, 2 / 3])
  # Seeds that agree leave only the examples' variation: the crossed interval is the one over examples.
  x = np.tile(np.random.default_rng(0).normal(0.3, 1.0, 400), (3, 1))
  crossed = bootstrap.mean_crossed(x, seed=1, resamples=4000)
  flat = bootstrap.mean(x[0], seed=1, resamples=4000)
  assert abs((crossed.hi - crossed.lo) - (flat.hi - flat.lo)) < 0.1 * (flat.hi - flat.lo)
  # ... and a large per-example effect shared by both tables cancels in the pairing
  base = np.random.default_rng(1).normal(0.0, 10.0, (3, 300))
  d = bootstrap.paired_difference_crossed(base + 0.2, base, seed=2)
  assert d.lo == pytest.approx(0.2) and d.hi == pytest.approx(0.2)
  with pytest.raises(ValueError, match="same shape"):
    bootstrap.paired_difference_crossed(np.ones((3, 4)), np.ones((3, 5)))
  with pytest.raises(ValueError, match=r"\[seeds, examples\]"):
    bootstrap.mean_crossed(np.ones(5))


def test_paired_difference_is_the_normal_interval_of_the_mean_difference():
  rng = np.random.default_rng(0)
  n = 4000
  d = np.where(rng.random(n) < 0.5, -1.0, 1.0) + 0.2
  iv = bootstrap.paired_difference(d + 5.0, np.full(n, 5.0), seed=5)
  half = 1.96 * d.std() / np.sqrt(n)
  assert iv.estimate == pytest.approx(d.mean())
  assert iv.lo == pytest.approx(d.mean() - half, abs=0.15 * half)
  assert iv.hi == pytest.approx(d.mean() + half, abs=0.15 * half)
