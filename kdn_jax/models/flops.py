"""Model FLOPs per trained token of a LanguageModel: the count behind the runner's TFLOP/s and MFU.

The count, per token of a training window of ``T`` tokens (a multiply-add is 2 FLOPs; elementwise work,
norms, softmax, gates, gains and the optimizer are left out, as MFU conventionally does):

1. **Weights.** A token's activation vector meets every weight of a dense projection once: 2 FLOPs per
   weight. Those are every non-embedding parameter plus the output projection's ``vocab x d_model``
   (the input embedding is a lookup, no FLOPs; with tied embeddings its table is the output
   projection, counted once as such). Small non-matmul parameters (norm scales, biases, the depthwise
   conv kernels, decay parameters) are counted the same way: they are small next to the
   projections, and the count stays a plain function of the parameter count. Forward: ``2 N`` with
   ``N = non-embedding params + vocab_size * d_model``.
2. **Recurrent mixers**, per layer and token, forward, from the recurrence (the algorithm's FLOPs,
   not those of its chunked implementation): a state of ``H`` heads of ``K x V`` (the mixer's own
   ``init_state`` shape, so multi-value-head variants count what they keep). The output read
   ``q^T S`` is ``2 H K V``; the write ``k u^T`` added to the state is ``2 H K V``; the delta-rule
   mixers (kdn_diag, kdn_iso, kda, gated_deltanet, deltanet, gdn2) also read ``S^T k`` to form the
   correction ``u = beta (v - S^T k)``: another ``2 H K V``. So ``6 H K V`` for the delta rule,
   ``4 H K V`` for the plain linear recurrences (gla, mamba2).
3. **Attention**, per layer and token, forward: ``q k^T`` and ``p v`` over the token's causal context
   of ``c`` positions, ``2 * 2 * H * head_dim * c``. Position ``t`` (1-based) of a window sees
   ``c = t`` (full attention) or ``min(t, w)`` (sliding window ``w``), so the mean over the window is
   ``(T + 1) / 2`` or ``mean_t min(t, w)``. Packed documents see less (segments restart); the count
   keeps the whole window, an upper bound.
4. **Training** = forward + backward, where the backward of a product costs two products of the same
   size (the gradient for each operand): ``3 x`` forward.

Hence ``train_flops_per_token = 3 * (2 N + sum over layers of 2.-3.)``, the "6 N" rule plus the
mixers' own token-mixing FLOPs. ``tests/models/test_flops.py`` checks it against a count by hand.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import ml_collections
from flax import nnx

from kdn_jax.layers.registry import is_recurrent, make_mixer
from kdn_jax.models.config import layer_mixers
from kdn_jax.models.param_counts import param_count

DELTA_RULE_MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet", "deltanet", "gdn2")
LINEAR_MIXERS = ("gla", "mamba2")


def mean_causal_context(seq_len: int, window: int | None = None) -> float:
  """Mean number of positions a token attends to over a window of ``seq_len`` (itself included)."""
  T = int(seq_len)
  if window is None or window >= T:
    return (T + 1) / 2
  w = int(window)
  return (w * (w + 1) / 2 + (T - w) * w) / T


def _state_size(name: str, cfg) -> int:
  """H * K * V of the mixer's recurrent memory (no parameter is materialised)."""
  state = jax.eval_shape(lambda: make_mixer(name, cfg, rngs=nnx.Rngs(0)).init_state(1))
  return math.prod(state["memory"].shape[1:])


def mixer_flops_per_token(name: str, cfg, seq_len: int) -> float:
  """Forward FLOPs per token of one mixer layer's token mixing (items 2 and 3 of the module's count)."""
  if name in DELTA_RULE_MIXERS:
    return 6.0 * _state_size(name, cfg)
  if name in LINEAR_MIXERS:
    return 4.0 * _state_size(name, cfg)
  if is_recurrent(name):
    raise ValueError(f"mixer: {name!r} has no FLOP count; add it to kdn_jax/models/flops.py")
  window = int(cfg.swa_window) if name == "swa" else None
  heads = int(cfg.num_heads) * int(cfg.head_dim)
  return 4.0 * heads * mean_causal_context(seq_len, window)


@functools.lru_cache(maxsize=32)
def _cached(model_json: str, seq_len: int) -> dict:
  cfg = ml_collections.ConfigDict(json.loads(model_json))
  dense = param_count(cfg)["non_embedding"] + int(cfg.vocab_size) * int(cfg.d_model)
  mixing = sum(mixer_flops_per_token(m, cfg, seq_len) for m in layer_mixers(cfg))
  return {
    "dense_params": dense,
    "forward": 2.0 * dense + mixing,
    "train": 3.0 * (2.0 * dense + mixing),
  }


def flops_per_token(cfg, seq_len: int) -> dict:
  """{'dense_params': N, 'forward': FLOPs, 'train': FLOPs} per token for the model config ``cfg``
  trained on windows of ``seq_len`` tokens (the count of the module docstring)."""
  return dict(_cached(ml_collections.ConfigDict(cfg).to_json(sort_keys=True), int(seq_len)))
