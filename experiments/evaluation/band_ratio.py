"""The length ratio over doubling position bands, with bootstrap intervals over windows.

Positions 0 .. L-1 of a window (L a power of two) fall into the bands [0, 1), [1, 2), [2, 4), ...,
[L/2, L). Each window contributes its mean NLL per band (``band_nll``: [windows, bands]), the
units every interval here resamples.

    R = PPL[L/2, L) / min over the reference bands of PPL[band]

where the reference bands are those inside the training length T that skip its first eighth,
[T/8, T/4), [T/4, T/2), [T/2, T) (their few early positions carry little context). The band that
attains the minimum is chosen again in every resample (the minimum of noisy means sits below the
true one; choosing once would understate the interval). Trends over checkpoints are paired: the
checkpoints of a run are scored on the same windows, so one draw of windows serves every checkpoint
(``change``, ``trend``).
"""

from __future__ import annotations

import numpy as np

from experiments.evaluation import bootstrap


def band_edges(length: int) -> list[int]:
  """[0, 1, 2, 4, ..., length]; ``length`` a power of two >= 2."""
  if length < 2 or length & (length - 1):
    raise ValueError(f"band edges: the length must be a power of two >= 2, got {length}")
  return [0] + [1 << k for k in range(length.bit_length())]


def band_nll(nll, edges) -> np.ndarray:
  """[windows, bands] mean NLL of each window per band of ``edges`` (nll: [windows, positions])."""
  nll = np.asarray(nll, np.float64)
  return np.stack([nll[:, a:b].mean(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)


def reference_bands(edges, train_len: int) -> list[int]:
  """Indices of the bands [lo, hi) with hi <= T and lo >= T / 8."""
  ref = [i for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])) if b <= train_len]
  ref = [i for i in ref if edges[i] >= train_len / 8]
  if not ref:
    raise ValueError(f"band ratio: no band lies in [T/8, T) for T = {train_len}")
  return ref


def in_range_bands(edges, train_len: int) -> list[int]:
  """Indices of every band inside the training length (hi <= T)."""
  return [i for i, b in enumerate(edges[1:]) if b <= train_len]


def log_ratio(means, ref) -> np.ndarray:
  """log R from band means [..., bands]: the last band against the minimum over ``ref``."""
  means = np.asarray(means, np.float64)
  return means[..., -1] - means[..., ref].min(axis=-1)


def in_range_nll(means, edges, train_len: int) -> np.ndarray:
  """Mean NLL over positions [0, T) from band means [..., bands] (bands weighted by width)."""
  idx = in_range_bands(edges, train_len)
  w = np.diff(np.asarray(edges, np.float64))[idx]
  return np.asarray(means, np.float64)[..., idx] @ w / w.sum()


def _exp(iv: bootstrap.Interval) -> dict:
  d = iv.to_json()
  return dict(
    d, estimate=float(np.exp(d["estimate"])), lo=float(np.exp(d["lo"])), hi=float(np.exp(d["hi"]))
  )


def ratio(bands, edges, train_len: int, **kw) -> dict:
  """R with its percentile interval (``kw``: level, resamples, seed), as JSON."""
  ref = reference_bands(edges, train_len)
  return _exp(bootstrap.of_means(lambda m: log_ratio(m, ref), bands, **kw))


def change(before, after, edges, train_len: int, **kw) -> dict:
  """R(after) / R(before) on the same windows (paired), as JSON."""
  ref = reference_bands(edges, train_len)
  return _exp(
    bootstrap.of_means(lambda a, b: log_ratio(b, ref) - log_ratio(a, ref), before, after, **kw)
  )


def trend(bands_list, x, edges, train_len: int, **kw) -> dict:
  """The least-squares slope of log R against ``x`` over checkpoints scored on the same windows,
  as the factor exp(slope) per unit of x (x = log2 tokens: R's factor per doubling), as JSON."""
  x = np.asarray(x, np.float64)
  if len(x) != len(bands_list) or len(x) < 2:
    raise ValueError(f"band ratio trend: needs >= 2 checkpoints with an x each, got {len(x)}")
  ref = reference_bands(edges, train_len)
  xc = (x - x.mean()) / np.sum((x - x.mean()) ** 2)

  def slope(*means):
    return sum(c * log_ratio(m, ref) for c, m in zip(xc, means))

  return _exp(bootstrap.of_means(slope, *bands_list, **kw))


def in_range_cost(control, treated, edges, train_len: int, **kw) -> dict:
  """PPL over [0, T) of ``treated`` / that of ``control`` on the same windows, as JSON."""
  return _exp(
    bootstrap.of_means(
      lambda c, t: in_range_nll(t, edges, train_len) - in_range_nll(c, edges, train_len),
      control,
      treated,
      **kw,
    )
  )
