"""Per-example MQAR correctness of every member of a trained sweep on fixed (length, pairs) cells.

The cells' examples come from :func:`experiments.data.retrieval.grid` (``synthetic.mqar_example``, the
reference generator), deterministic in ``seed``: one seed for a validation split that picks learning
rates, another for the test split that is reported. A cell shorter than ``min_len`` is right-padded to it
(the models are causal: positions after a row's end change none of its predictions), so cells of a few
lengths share one compiled forward pass; logits are read only at the scored query positions.

    cells = mqar_cells.make_cells([(64, 4), (1024, 256)], num_examples=1000, seed=2, vocab_size=8192)
    counts = mqar_cells.correct_counts(trainer, cells, min_len=256)  # per cell: int [members, examples]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.data import retrieval
from experiments.runner import loss as loss_lib
from experiments.runner import sharding


def make_cells(
  spec: Sequence[tuple[int, int]],
  num_examples: int,
  seed: int,
  vocab_size: int,
  power_a: float = 0.01,
) -> list[dict]:
  """``[{'seq_len', 'num_kv_pairs', 'examples': {'inputs', 'targets', 'mask'} [N, T]}]`` per (T, pairs)."""
  out = []
  for t, n in spec:
    (cell,) = retrieval.grid(
      "mqar",
      [int(t)],
      [int(n)],
      int(num_examples),
      int(seed),
      vocab_size=vocab_size,
      power_a=power_a,
    )
    out.append({"seq_len": int(t), "num_kv_pairs": int(n), "examples": cell["examples"]})
  return out


def _pad(examples: dict, length: int) -> dict:
  t = examples["inputs"].shape[1]
  return {k: np.pad(v, ((0, 0), (0, length - t))) for k, v in examples.items()}


def _counter(trainer, count: int):
  """jit: (stacked params, batch) -> int32 [members, rows] scored positions predicted correctly."""

  def one(params, batch):
    model = trainer.merge(params, trainer.rest)
    logits, _, targets, mask, _ = loss_lib.scored_logits(model, batch, count)
    hit = (jnp.argmax(logits, -1) == targets) & (mask > 0)
    return jnp.sum(hit, axis=1).astype(jnp.int32)

  # members one after another: [rows, count, vocab] logits per member are what fills memory first
  fn = jax.jit(lambda params, batch: jax.lax.map(lambda p: one(p, batch), params))
  return sharding.traced_context_parallel(trainer.mesh, fn)


def stacked_params(trainer):
  """The trainer's parameters with a leading member axis (a single run is one member)."""
  params = trainer.state["params"]
  return params if hasattr(trainer, "members") else jax.tree.map(lambda x: x[None], params)


def correct_counts(
  trainer, cells: list[dict], min_len: int = 0, rows: int = 64
) -> list[np.ndarray]:
  """Per cell: int [members, examples], each example's correctly predicted query values (teacher-forced
  argmax at the scored positions; ``num_kv_pairs`` of them per example)."""
  params = stacked_params(trainer)
  buckets = {}  # padded length -> the most pairs among its cells: one compiled pass per bucket
  for c in cells:
    length = max(c["seq_len"], int(min_len))
    buckets[length] = max(buckets.get(length, 0), c["num_kv_pairs"])
  cache = trainer.__dict__.setdefault(
    "_mqar_counters", {}
  )  # compiled once per (length, pairs) per trainer
  counters = {
    length: cache.setdefault((length, count), _counter(trainer, count))
    for length, count in buckets.items()
  }
  out = []
  for c in cells:
    length = max(c["seq_len"], int(min_len))
    ex = _pad(c["examples"], length)
    n = len(ex["inputs"])
    parts = []
    for s in range(0, n, rows):
      batch = {k: v[s : s + rows] for k, v in ex.items()}
      short = rows - len(batch["inputs"])
      if short:  # the last rows padded to a full batch (one shape per bucket), their counts dropped
        batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
      got = np.asarray(jax.device_get(counters[length](params, batch)))
      parts.append(got[:, : rows - short])
    out.append(np.concatenate(parts, axis=1))
  return out
