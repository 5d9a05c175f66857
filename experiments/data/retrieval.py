"""Evaluation task grids for length generalisation: RULER-style S-NIAH-1/2/3 (examples made in
experiments/data/snih.py), passkey, copying and MQAR.

Every example is deterministic in ``(seed, index)`` and has the layout of :mod:`experiments.data.synthetic`:
``{'inputs': int32[T], 'targets': int32[T], 'mask': float32[T]}`` with ``targets`` = inputs shifted by one
(both cut from one sequence of ``T + 1`` tokens) and ``mask`` = 1 at the scored positions ``t`` (the
prediction of ``targets[t]`` counts). ``inputs`` is always exactly the requested length ``T``. Teacher-forced
exact match = every scored position predicted (argmax) correctly; :func:`score` computes it.

    cells = retrieval.grid('snih2', lengths=(1024, 4096), points=(0.0, 0.5, 1.0), num_examples=64, seed=0,
                           tokenizer=tok, haystack_tokens=val_tokens)
    for cell in cells:  # {'task', 'length', 'axis', cell['axis']: point, 'examples', 'meta'}
      ...               # cell['examples'] = {'inputs': [N, T], 'targets': [N, T], 'mask': [N, T]}

Tasks (``TASKS``) and the second grid axis (``AXIS[task]``, the meaning of ``points``):

* ``snih1`` / ``snih2`` / ``snih3`` (RULER single needle; need ``tokenizer``, 2 and 3 also
  ``haystack_tokens``). Text is built piecewise and each piece is BPE-encoded on its own, every piece starting
  at a word boundary (leading space / newline), so the pieces join at token boundaries and the needle is never
  cut mid-token::

      haystack[:p] + NEEDLE(key, value) + haystack[p:] + QUERY(key) + ' ' + value

  with the needle " One of the special magic numbers for {key} is: {value}." and the query "\\nWhat is the
  special magic number for {key} mentioned in the provided text? The special magic number for {key}
  mentioned in the provided text is". The haystack is trimmed so the whole sequence is exactly ``T + 1``
  tokens. Scored positions: the answer tokens " {value}" (the last ones of the sequence; the first is predicted
  from the final query token "is"). Haystacks: snih1 = the noise "The grass is green. ... There and back
  again." repeated; snih2/3 = a contiguous slice of ``haystack_tokens`` (a corpus token array, e.g. the val
  split) starting at a seeded offset (circular; EOS tokens dropped by default, ``drop_eos``). Keys are
  "adjective-noun" words (``snih.ADJECTIVES`` x ``snih.NOUNS``); values a 7-digit number (snih1/2) or a uuid4 string
  (snih3). A key or value that occurs in the haystack text (case-insensitive) is redrawn, so the key occurs
  only in the needle and the query and the value only in the needle and the answer.
  **depth** (``points``, fractions in [0, 1]): the needle starts at haystack token ``p ~= depth * H``
  (``H`` = haystack tokens in this example; 0 = right after the start of the sequence, 1 = right before the
  query), snapped to the nearest sentence end (a token whose text ends in . ! ? or a newline) within
  ``min(snap, H // 10)`` tokens, else exactly ``round(depth * H)``. ``meta`` records key, value, needle_start
  (index into ``inputs``), needle_len, haystack_len and answer_len.
* ``passkey`` (needs ``vocab_size``; ``digits`` = 5): :func:`synthetic.passkey_example` with a fixed
  **depth**: the KEY token sits at ``round(depth * (T - 2 * digits - 2))``. Scored: the digits after QUERY.
* ``copy`` (needs ``vocab_size``): :func:`synthetic.copying_example`; axis **copy_len** (``None`` = the
  longest that fits, ``(T - 1) // 2``). Scored: the copied half.
* ``mqar`` (needs ``vocab_size``; ``power_a`` = 0.01): :func:`synthetic.mqar_example`; axis **num_kv_pairs**
  (required). Scored: the value after each query key.

The same ``(seed, index)`` gives the same random draws in every cell of a grid where the task allows it (for
S-NIAH: the same key, value and haystack offset at every depth; lengths change only the haystack length), so
cells are paired comparisons. :func:`example_fn` gives the per-cell ``index -> example`` function (wrap it in
``grain.MapDataset.range(n).map(fn)`` for a lazy pipeline).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.data import snih, synthetic

TASKS = ("mqar", "snih1", "snih2", "snih3", "passkey", "copy")
AXIS = {
  "mqar": "num_kv_pairs",
  "snih1": "depth",
  "snih2": "depth",
  "snih3": "depth",
  "passkey": "depth",
  "copy": "copy_len",
}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

_TASK_KW = {  # allowed task keyword arguments and their defaults (None = required)
  "mqar": {"vocab_size": None, "power_a": 0.01},
  "passkey": {"vocab_size": None, "digits": 5},
  "copy": {"vocab_size": None},
  "snih1": snih.DEFAULTS,
  "snih2": snih.DEFAULTS,
  "snih3": {k: v for k, v in snih.DEFAULTS.items() if k != "value_digits"},
}


# ------------------------------------------------------------------------------------------------- grid


def _resolve(task: str, tokenizer, haystack_tokens, task_kw: dict) -> dict:
  """Validates the task and its arguments (before any work); returns the task keywords with defaults."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
  if task.startswith("snih") and tokenizer is None:
    raise ValueError(f"task {task!r} needs tokenizer= (a BPETokenizer)")
  if task in ("snih2", "snih3") and haystack_tokens is None:
    raise ValueError(
      f"task {task!r} needs haystack_tokens= (a 1-D corpus token array, e.g. the val split)"
    )
  if task not in ("snih2", "snih3") and haystack_tokens is not None:
    raise ValueError(f"task {task!r} takes no haystack_tokens")
  allowed = _TASK_KW[task]
  unknown = sorted(set(task_kw) - set(allowed))
  if unknown:
    raise ValueError(f"task {task!r}: unknown argument(s) {unknown}; allowed: {sorted(allowed)}")
  kw = {**allowed, **task_kw}
  missing = [k for k, v in kw.items() if v is None]
  if missing:
    raise ValueError(f"task {task!r} needs {', '.join(f'{k}=' for k in missing)}")
  return kw


def _points(task: str, points) -> list:
  axis = AXIS[task]
  if points is None:
    if task == "mqar":
      raise ValueError('task "mqar" needs points= (the num_kv_pairs values)')
    return [None] if task == "copy" else list(DEPTHS)
  pts = list(points)
  if not pts:
    raise ValueError(f"task {task!r}: points is empty")
  for p in pts:
    if axis == "depth":
      if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"task {task!r}: depth must be in [0, 1], got {p}")
    elif p is not None and (int(p) != p or p < 1):
      raise ValueError(f"task {task!r}: {axis} must be a positive integer, got {p}")
  return [None if p is None else (float(p) if axis == "depth" else int(p)) for p in pts]


def min_length(task: str, point=None, *, tokenizer=None, **task_kw) -> int:
  """The shortest sequence length for which every example of ``task`` at ``point`` fits (for S-NIAH an upper
  bound over keys/values)."""
  kw = {**{k: v for k, v in _TASK_KW[task].items() if v is not None}, **task_kw}
  if task.startswith("snih"):
    return snih.snih_min_length(
      tokenizer,
      value_kind="uuid" if task == "snih3" else "number",
      value_digits=kw.get("value_digits", 7),
      adjectives=kw["adjectives"],
      nouns=kw["nouns"],
    )
  if task == "passkey":
    return 2 * kw["digits"] + 2
  if task == "copy":
    return 3 if point is None else 2 * point + 1
  if task == "mqar":
    return 4 * point - 1
  raise ValueError(f"unknown task {task!r}")


def _check_cell(task: str, length: int, point, kw: dict, tokenizer) -> None:
  if int(length) != length or length < 1:
    raise ValueError(f"task {task!r}: lengths must be positive integers, got {length}")
  if task == "mqar" and point >= kw["vocab_size"] // 2 - 1:
    raise ValueError(
      f"mqar: num_kv_pairs={point} needs vocab_size > {2 * (point + 1)} (distinct keys)"
    )
  need = min_length(task, point, tokenizer=tokenizer, **kw)
  if length < need:
    raise ValueError(
      f"task {task!r}: length {length} is too short ({AXIS[task]}={point}); needs at least {need}"
    )


def _generator(
  task: str, length: int, point, *, seed: int, tokenizer, haystack_tokens, kw: dict
) -> Callable[[int], tuple[dict, dict]]:
  """``index -> (example, meta)`` for one cell; arguments already validated."""
  if task.startswith("snih"):
    skw = dict(kw)
    if task == "snih3":
      skw["value_kind"] = "uuid"
    return functools.partial(
      snih.snih_example,
      seed=seed,
      seq_len=length,
      depth=point,
      tokenizer=tokenizer,
      haystack_tokens=haystack_tokens,
      return_meta=True,
      **skw,
    )
  if task == "passkey":
    d = kw["digits"]

    def fn(i):
      ex = synthetic.passkey_example(
        i, seed=seed, seq_len=length, vocab_size=kw["vocab_size"], digits=d, depth=point
      )
      return ex, {"key_pos": int(round(point * (length - 2 * d - 2)))}

    return fn
  if task == "copy":
    n = (length - 1) // 2 if point is None else point
    return lambda i: (
      synthetic.copying_example(
        i, seed=seed, seq_len=length, vocab_size=kw["vocab_size"], copy_len=n
      ),
      {"copy_len": n},
    )
  if task == "mqar":
    return lambda i: (
      synthetic.mqar_example(
        i,
        seed=seed,
        seq_len=length,
        vocab_size=kw["vocab_size"],
        num_kv_pairs=point,
        power_a=kw["power_a"],
      ),
      {},
    )
  raise ValueError(task)


def example_fn(
  task: str,
  length: int,
  point=None,
  *,
  seed: int = 0,
  tokenizer=None,
  haystack_tokens=None,
  **task_kw,
) -> Callable[[int], dict]:
  """The validated ``index -> example`` function of one grid cell (``point`` along ``AXIS[task]``)."""
  kw = _resolve(task, tokenizer, haystack_tokens, task_kw)
  if point is None and task != "copy":
    raise ValueError(f"task {task!r} needs point= (its {AXIS[task]})")
  (point,) = _points(task, [point])
  _check_cell(task, length, point, kw, tokenizer)
  gen = _generator(
    task, length, point, seed=seed, tokenizer=tokenizer, haystack_tokens=haystack_tokens, kw=kw
  )
  return lambda i: gen(i)[0]


def grid(
  task: str,
  lengths: Sequence[int],
  points: Sequence | None = None,
  num_examples: int = 100,
  seed: int = 0,
  *,
  tokenizer=None,
  haystack_tokens: np.ndarray | None = None,
  stack: bool = True,
  **task_kw,
) -> list[dict[str, Any]]:
  """Evaluation cells for ``task`` over ``lengths`` x ``points`` (the values along ``AXIS[task]``: depths
  for snih*/passkey (default ``DEPTHS``), num_kv_pairs for mqar (required), copy_len for copy (default: the
  longest that fits each length)). Everything is validated before any example is generated.

  Returns a list (lengths outer, points inner) of ``{'task', 'length', 'axis': AXIS[task], <axis>: point,
  'examples', 'meta'}``: ``examples`` is a stacked batch ``{'inputs','targets': int32[N, T], 'mask':
  float32[N, T]}`` (a list of per-example dicts with ``stack=False``), ``meta`` a list of per-example dicts
  (S-NIAH: key, value, needle_start, needle_len, haystack_len, answer_len, haystack_start; passkey: key_pos;
  copy: copy_len).
  """
  kw = _resolve(task, tokenizer, haystack_tokens, task_kw)
  pts = _points(task, points)
  lengths = list(lengths)
  if not lengths:
    raise ValueError("lengths is empty")
  if int(num_examples) != num_examples or num_examples < 1:
    raise ValueError(f"num_examples must be a positive integer, got {num_examples}")
  for length in lengths:
    for p in pts:
      _check_cell(task, length, p, kw, tokenizer)
  if haystack_tokens is not None and len(haystack_tokens) < max(lengths) + 1:
    raise ValueError(
      f"haystack_tokens has {len(haystack_tokens)} tokens, fewer than the longest length + 1 "
      f"= {max(lengths) + 1}"
    )
  axis = AXIS[task]
  cells = []
  for length in lengths:
    for p in pts:
      gen = _generator(
        task, int(length), p, seed=seed, tokenizer=tokenizer, haystack_tokens=haystack_tokens, kw=kw
      )
      pairs = [gen(i) for i in range(int(num_examples))]
      exs = [e for e, _ in pairs]
      if stack:
        exs = {k: np.stack([e[k] for e in exs]) for k in exs[0]}
      value = pairs[0][1]["copy_len"] if task == "copy" else p
      cells.append(
        {
          "task": task,
          "length": int(length),
          "axis": axis,
          axis: value,
          "examples": exs,
          "meta": [m for _, m in pairs],
        }
      )
  return cells


# ---------------------------------------------------------------------------------------------- scoring


def score(correct, mask) -> dict:
  """Teacher-forced scores from per-position argmax-correct booleans ``correct[B, T]`` and ``mask[B, T]``.

  ``exact_match``: the fraction of examples (with at least one scored position) whose scored positions are
  all correct; ``token_accuracy``: the fraction of scored positions that are correct. Also the counts
  ``num_examples`` / ``num_tokens`` (to pool batches) and ``per_example`` (bool[B], exact match per row;
  rows without scored positions count as True but are excluded from ``exact_match``)."""
  correct = np.asarray(correct, bool)
  m = np.asarray(mask) > 0
  if correct.shape != m.shape or correct.ndim != 2:
    raise ValueError(
      f"score: correct {correct.shape} and mask {m.shape} must be the same [B, T] shape"
    )
  rows = m.any(axis=1)
  per_example = np.all(correct | ~m, axis=1)
  n_tok = int(m.sum())
  return {
    "exact_match": float(per_example[rows].mean()) if rows.any() else float("nan"),
    "token_accuracy": float((correct & m).sum() / n_tok) if n_tok else float("nan"),
    "num_examples": int(rows.sum()),
    "num_tokens": n_tok,
    "per_example": per_example,
  }


def score_predictions(predictions, targets, mask) -> dict:
  """:func:`score` of ``predictions == targets`` (argmax ids ``[B, T]``)."""
  return score(np.asarray(predictions) == np.asarray(targets), mask)
