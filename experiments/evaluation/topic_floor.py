"""Excess NLL over the exact Bayes floor of the topic source, by position, with bootstrap intervals
over evaluation documents (the documents are the unit), and the length-generalisation verdict.

Excess at position t = model NLL - floor NLL of the target x_t (``-log p(x_t | x_{<t})`` under the
true source), averaged over a document's positions in a window, then over documents. The verdict
compares two windows: ``early`` = [T/2, T) (inside the training length T) and ``late`` = [4096,
8192):

  failure  when  mean excess(late) >= 3 x mean excess(early),

decided on ``late - 3 early`` (the same rule, defined whatever the sign of the early excess); the
interval of that margin says whether the documents support the verdict (``verdict_ci``: ``failure``
when its lower end is >= 0, ``no failure`` when its upper end is < 0, else ``undecided``). The ratio
late / early is reported with its interval too.
"""

from __future__ import annotations

import itertools

import numpy as np

from experiments.data import topic_source as ts
from experiments.evaluation import bootstrap

LATE = (4096, 8192)
THRESHOLD = 3.0
DEFAULT_DOCS = 64
DOC_STRIDE = 1_000_003  # evaluation seed s reads documents s * DOC_STRIDE + i of the EVAL split
CLAIM = (
  "Paper claim: recurrent LMs trained from the zero state at length T fail past T "
  "(excess NLL grows with position); State Passing / TBTT post-training removes it."
)


def evaluation_documents(
  source: ts.TopicSource, num_docs: int, length: int, seed: int = 0
) -> np.ndarray:
  """[num_docs, length] tokens: the first ``length`` tokens of EVAL-split documents chosen by
  ``seed``."""
  if length > source.params.doc_len:
    raise ValueError(
      f"--max_len: {length} is longer than the topic documents (data.topic.doc_len="
      f"{source.params.doc_len})"
    )
  return np.stack(
    [source.tokens(ts.EVAL, seed * DOC_STRIDE + i, 0, length) for i in range(num_docs)]
  )


def model_view(source: ts.TopicSource, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) [N, L]: inputs ``[BOS, x_0 .. x_{L-2}]``, targets ``x_0 .. x_{L-1}``."""
  bos = np.full((docs.shape[0], 1), source.params.bos_id, docs.dtype)
  return np.concatenate([bos, docs[:, :-1]], axis=1), docs


def window_means(values: np.ndarray, windows) -> np.ndarray:
  """[N, len(windows)] per-document means of ``values`` [N, L] over each [a, b) window."""
  return np.stack([values[:, a:b].mean(axis=1) for a, b in windows], axis=1)


def buckets(train_len: int, length: int) -> list[tuple[int, int]]:
  """Position buckets for the curve: one per position below 8, then 8 log-spaced per octave, with
  [T/2, T) and the late window's edges among the edges."""
  edges = set(range(min(8, length)))
  edges |= set(
    np.unique(np.geomspace(8, length, int(8 * np.log2(max(length / 8, 2))) + 1).round().astype(int))
  )
  edges |= {train_len // 2, train_len, LATE[0], LATE[1], length}
  edges = sorted(e for e in edges if 0 <= e <= length)
  return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def analyse(
  model_nll: np.ndarray,
  floor_nll: np.ndarray,
  train_len: int,
  *,
  seed: int = 0,
  resamples: int = bootstrap.RESAMPLES,
  level: float = bootstrap.LEVEL,
) -> dict:
  """The suite's numbers from per-position NLLs [N, L] of N documents (model and floor)."""
  model_nll, floor_nll = np.asarray(model_nll, np.float64), np.asarray(floor_nll, np.float64)
  n, length = model_nll.shape
  if length < LATE[1]:
    raise ValueError(f"--max_len: the verdict reads positions [{LATE[0]}, {LATE[1]}); got {length}")
  excess = model_nll - floor_nll
  kw = {"seed": seed, "resamples": resamples, "level": level}
  bks = buckets(train_len, length)
  per_doc = window_means(excess, bks)
  curve = bootstrap.mean(per_doc, **kw)
  early_w, late_w = (train_len // 2, train_len), LATE
  early, late = window_means(excess, [early_w])[:, 0], window_means(excess, [late_w])[:, 0]
  margin = bootstrap.mean(late - THRESHOLD * early, **kw)
  ratio = bootstrap.ratio_of_means(late, early, **kw)
  if margin.lo >= 0:
    decided = "failure"
  elif margin.hi < 0:
    decided = "no failure"
  else:
    decided = "undecided"
  return {
    "documents": n,
    "length": length,
    "train_len": train_len,
    "threshold": THRESHOLD,
    "early_window": list(early_w),
    "late_window": list(late_w),
    "early": bootstrap.mean(early, **kw).to_json(),
    "late": bootstrap.mean(late, **kw).to_json(),
    "ratio": ratio.to_json(),
    "margin": margin.to_json(),
    "verdict": "failure" if margin.estimate >= 0 else "no failure",
    "verdict_ci": decided,
    "mean_excess": float(excess.mean()),
    "model_nll": float(model_nll.mean()),
    "floor_nll": float(floor_nll.mean()),
    "bucket_edges": [int(a) for a, _ in bks] + [int(bks[-1][1])],
    "bucket_center": [0.5 * (a + b - 1) + 1.0 for a, b in bks],  # 1-based positions for a log axis
    "excess": curve.to_json(),
    "bucket_model_nll": window_means(model_nll, bks).mean(axis=0).tolist(),
    "bucket_floor_nll": window_means(floor_nll, bks).mean(axis=0).tolist(),
    "per_document": {"early": early.tolist(), "late": late.tolist()},
    "claim": CLAIM,
  }
