"""Batched scoring and generation for token requests of mixed lengths (the engine of the lm-evaluation-
harness adapter, experiments/lm_eval_adapter.py; no lm_eval import here).

``RequestRunner(model, chunk, batch, pad_id)``:
  ``score(sequences, num_scored)``  -> [(log p of the last num_scored tokens given the rest, all greedy)]
  ``generate(prompts, max_new_tokens, stop)`` -> generated token lists (greedy, or sampled)

Scoring is exact for any length: rows are right-padded (a causal model's real positions never see the
padding) to a few lengths (powers of two up to ``chunk``, then multiples of ``chunk``), and inputs longer
than ``chunk`` run chunk by chunk with the state carried (ChunkedScorer.score, as experiments.evaluate
does), so memory stays that of one chunk whatever the length. Generation cannot pad a prompt (the padding
would enter the recurrent state), so it batches prompts of equal length and compiles once per length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.evaluation import long_context
from kdn_jax.models.generate import sample_logits


def padded_length(n: int, chunk: int) -> int:
  """The compiled length a row of ``n`` inputs runs at: a power of two (>= 16) up to ``chunk``, else the next
  multiple of ``chunk``."""
  if n > chunk:
    return -(-n // chunk) * chunk
  p = 16
  while p < n:
    p *= 2
  return min(p, chunk)


class RequestRunner:
  def __init__(self, model, chunk: int, batch: int, pad_id: int):
    for name, v in (("chunk", chunk), ("batch", batch)):
      if int(v) < 1:
        raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    self.model, self.chunk, self.batch, self.pad_id = model, int(chunk), int(batch), int(pad_id)
    self.scorer = long_context.ChunkedScorer(model)
    self._gen = None

  # ------------------------------------------------------------------------------------------- scoring
  def score(
    self,
    sequences: Sequence[np.ndarray],
    num_scored: Sequence[int],
    on_batch: Callable[[int], None] | None = None,
  ) -> list[tuple[float, bool]]:
    """For each token sequence s (its first token is the prefix, e.g. EOS as BOS) and n = num_scored:
    (sum of log p(s[t] | s[:t]) over the last n positions, whether each of them is the argmax)."""
    if len(sequences) != len(num_scored):
      raise ValueError(f"num_scored: {len(num_scored)} entries for {len(sequences)} sequences")
    for i, (s, n) in enumerate(zip(sequences, num_scored)):
      if not 1 <= n <= len(s) - 1:
        raise ValueError(
          f"num_scored[{i}]: {n} outside [1, {len(s) - 1}] (a sequence of {len(s)} tokens, "
          "whose first token is only context)"
        )
    order = sorted(
      range(len(sequences)), key=lambda i: -len(sequences[i])
    )  # similar lengths together
    out: list = [None] * len(sequences)
    for start in range(0, len(order), self.batch):
      idx = order[start : start + self.batch]
      length = padded_length(max(len(sequences[i]) - 1 for i in idx), self.chunk)
      inputs = np.full((self.batch, length), self.pad_id, np.int32)
      targets = np.full((self.batch, length), self.pad_id, np.int32)
      for r, i in enumerate(idx):  # rows past len(idx) stay padding: one compiled batch size
        s = np.asarray(sequences[i], np.int32)
        inputs[r, : len(s) - 1], targets[r, : len(s) - 1] = s[:-1], s[1:]
      nll, correct = self.scorer.score(inputs, targets, self.chunk)
      for r, i in enumerate(idx):
        end = len(sequences[i]) - 1
        sel = slice(end - int(num_scored[i]), end)
        out[i] = (-float(np.sum(nll[r, sel], dtype=np.float64)), bool(np.all(correct[r, sel])))
      if on_batch:
        on_batch(len(idx))
    return out

  # ---------------------------------------------------------------------------------------- generation
  def _compiled(self):
    if self._gen is None:
      graphdef, state = nnx.split(self.model)

      def prefill(state, tokens, cache):
        logits, cache = nnx.merge(graphdef, state).prefill(tokens, cache)
        return logits[:, -1], cache

      def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state).decode_step(token, cache)
        return logits, cache

      pick = jax.jit(sample_logits, static_argnames=("temperature", "top_k"))
      self._gen = (
        state,
        jax.jit(prefill, donate_argnums=(2,)),
        jax.jit(step, donate_argnums=(2,)),
        pick,
      )
    return self._gen

  def generate(
    self,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int,
    stop: Callable[[int, list[int]], bool],
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
  ) -> list[list[int]]:
    """Tokens generated after each prompt, at most ``max_new_tokens``; a row ends once ``stop(i, tokens)``
    is true for prompt i and its tokens so far (the caller trims the stop text). The prompt is fed
    ``chunk`` tokens at a time with the state carried."""
    state, prefill, step, pick = self._compiled()
    rng = jax.random.key(seed)
    out: list = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
      if len(p) < 1:
        raise ValueError(f"prompts[{i}]: empty (it needs at least the prefix token)")
      by_len.setdefault(len(p), []).append(i)
    for length, members in sorted(by_len.items()):
      # the decode cache's length is rounded up so that few distinct caches (compiles) arise
      cache_len = (
        padded_length(length + max_new_tokens, self.chunk) if max_new_tokens > 0 else length
      )
      for start in range(0, len(members), self.batch):
        idx = members[start : start + self.batch]
        rows = np.stack(
          [np.asarray(prompts[i], np.int32) for i in idx]
          + [np.asarray(prompts[idx[-1]], np.int32)] * (self.batch - len(idx))
        )
        cache = self.model.init_cache(self.batch, cache_len)
        for s in range(0, length, self.chunk):
          last, cache = prefill(state, jnp.asarray(rows[:, s : s + self.chunk]), cache)
        new = [[] for _ in idx]
        done = [False] * len(idx)
        for _ in range(max_new_tokens):
          rng, sub = jax.random.split(rng)
          tok = pick(last, sub, temperature=float(temperature), top_k=top_k)
          host = np.asarray(tok)
          for r, i in enumerate(idx):
            if not done[r]:
              new[r].append(int(host[r]))
              done[r] = stop(i, new[r])
          if all(done):
            break
          last, cache = step(state, tok, cache)
        for r, i in enumerate(idx):
          out[i] = new[r]
        if on_batch:
          on_batch(len(idx))
    return out
