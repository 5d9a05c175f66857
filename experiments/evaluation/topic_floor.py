"""Excess NLL over a synthetic source's exact Bayes floor by position, with bootstrap intervals over
evaluation documents (the documents are the unit), and the length-generalisation verdict.

Excess at position t = model NLL - floor NLL of the target x_t (``-log p(x_t | x_{<t})`` under the
true source), averaged over a document's positions in a window, then over documents. Two windows
are compared: ``early`` = [T/2, T) (inside the training length T) and ``late`` = [4096, 8192).

The verdict is the paper's own measure, as the text study's rule states it: the model's
perplexity late over its perplexity early, ``exp(mean NLL(late) - mean NLL(early))`` paired over
documents, with its percentile-bootstrap interval:

  failure     when the ratio is >= 1.5 and its interval's lower end >= 1.3,
  no failure  when the interval's upper end is < 1.5,
  undecided   otherwise.

Beside it, the growth of the gap to the floor, ``excess(late) - excess(early)`` in nats with its
interval: how much of what the source offers past T a model leaves unused (the floor falls with
position, so a model can fall short of it without its perplexity climbing).
"""

from __future__ import annotations

import itertools

import ml_collections
import numpy as np

from experiments.data import topic_source as ts
from experiments.evaluation import bootstrap

LATE = (4096, 8192)
FAILURE_RATIO = 1.5  # the paper's failures: perplexity past T at least 1.5x its value inside T
FAILURE_LOWER = 1.3  # ... with the interval's lower end at least this
RULE = (
  f"failure when PPL(late) / PPL(early) >= {FAILURE_RATIO:g} with the 95% interval's lower end >= "
  f"{FAILURE_LOWER:g}; no failure when the upper end < {FAILURE_RATIO:g}; else undecided"
)
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
  per_document = window_means(excess, bks)
  curve = bootstrap.mean(per_document, **kw)
  windows = [(train_len // 2, train_len), LATE]
  (early, late), (nll_early, nll_late) = (window_means(x, windows).T for x in (excess, model_nll))
  return {
    "documents": n,
    "length": length,
    "train_len": train_len,
    "early_window": list(windows[0]),
    "late_window": list(windows[1]),
    **verdict(early, late, nll_early, nll_late, **kw),
    "mean_excess": float(excess.mean()),
    "model_nll": float(model_nll.mean()),
    "floor_nll": float(floor_nll.mean()),
    "bucket_edges": [int(a) for a, _ in bks] + [int(bks[-1][1])],
    "bucket_center": [0.5 * (a + b - 1) + 1.0 for a, b in bks],  # 1-based positions for a log axis
    "excess": curve.to_json(),
    # the bootstrap units, for intervals of differences between runs (experiments.compare)
    "bucket_excess_per_document": per_document.tolist(),
    "bucket_model_nll": window_means(model_nll, bks).mean(axis=0).tolist(),
    "bucket_floor_nll": window_means(floor_nll, bks).mean(axis=0).tolist(),
    "claim": CLAIM,
  }


def verdict(early, late, nll_early, nll_late, **kw) -> dict:
  """The verdict's fields from per-document window means: excess over the floor and model NLL,
  early and late (kw: the bootstrap's seed, resamples, level)."""
  early, late, nll_early, nll_late = (
    np.asarray(x, np.float64) for x in (early, late, nll_early, nll_late)
  )
  log_ratio = bootstrap.mean(nll_late - nll_early, **kw)
  ratio = {
    **log_ratio.to_json(),
    **{k: float(np.exp(getattr(log_ratio, k))) for k in ("estimate", "lo", "hi")},
  }
  if ratio["estimate"] >= FAILURE_RATIO and ratio["lo"] >= FAILURE_LOWER:
    decided = "failure"
  elif ratio["hi"] < FAILURE_RATIO:
    decided = "no failure"
  else:
    decided = "undecided"
  return {
    "early": bootstrap.mean(early, **kw).to_json(),
    "late": bootstrap.mean(late, **kw).to_json(),
    "nll_early": bootstrap.mean(nll_early, **kw).to_json(),
    "nll_late": bootstrap.mean(nll_late, **kw).to_json(),
    "ppl_ratio": ratio,
    "excess_growth": bootstrap.mean(late - early, **kw).to_json(),
    "verdict": decided,
    "rule": RULE,
    "per_document": {
      "early": early.tolist(),
      "late": late.tolist(),
      "nll_early": nll_early.tolist(),
      "nll_late": nll_late.tolist(),
    },
  }


def with_verdict(tf: dict, *, resamples: int = bootstrap.RESAMPLES) -> dict:
  """A stored topic_floor result with the verdict's fields; a result written before they existed
  (per-document excesses only) gets its per-document model NLLs back from the floor, which is
  recomputed exactly from the source settings and evaluation seed it recorded."""
  if "ppl_ratio" in tf:
    return tf
  source = ts.TopicSource(ts.params_from_config(ml_collections.ConfigDict(tf["source"])))
  docs = evaluation_documents(source, tf["documents"], tf["length"], seed=tf["seed"])
  _, targets = model_view(source, docs)
  floor = source.bayes_nll(targets)
  windows = [tuple(tf["early_window"]), tuple(tf["late_window"])]
  f_early, f_late = window_means(floor, windows).T
  early, late = (np.asarray(tf["per_document"][k]) for k in ("early", "late"))
  kept = {k: v for k, v in tf.items() if k not in ("threshold", "ratio", "margin", "verdict_ci")}
  return {
    **kept,
    **verdict(early, late, early + f_early, late + f_late, seed=tf["seed"], resamples=resamples),
  }
