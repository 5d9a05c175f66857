"""Parameter counts of a whole LanguageModel, by kind (embedding, mixer, MLP, norm).

Kept apart from config.py: it builds the model (lm.py), and lm.py imports config.py.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from kdn_jax.models.lm import LanguageModel


def param_count(cfg) -> dict:
  """Counts of the real model via nnx.eval_shape (nothing is materialised).

  Returns dict(total, embedding, non_embedding, mixer, mlp, norm)."""
  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  out = dict(total=0, embedding=0, mixer=0, mlp=0, norm=0)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    n = math.prod(leaf.shape)
    keys = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
    out["total"] += n
    if keys[0] in ("embed", "lm_head"):
      out["embedding"] += n
    elif "mixer" in keys:
      out["mixer"] += n
    elif "mlp" in keys:
      out["mlp"] += n
    else:
      out["norm"] += n
  out["non_embedding"] = out["total"] - out["embedding"]
  return out
