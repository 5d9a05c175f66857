"""Carry-forward initial states for length generalisation (docs/math.md §7).

States are the model's per-layer list: ``None`` for attention layers, a dict with 'memory' [B,H,K,V],
'variance' ([B,H,K] or [B,H], positive) and 'conv' caches for recurrent layers. Every function here is pure
and jit-friendly. The strategies (``config.train.initial_state``):

* ``zero``          the model's normal start (``model.init_states``), every step.
* ``random_noise``  memory ~ iid N(0, sigma^2); variance and conv caches at their normal start.
* ``fitted_noise``  per layer and head running mean/var of final states (memory; log of variance),
                    ``stat <- (1-beta) * current + beta * previous`` with beta = 0.1, sampled iid every step
                    (variance = exp(sample) stays positive). Until the first update the normal start is used.
* ``state_passing`` the previous batch's final states (stop-gradient); each row is reset to the normal start
                    with probability ``state_reset_prob`` (and every row on the first step).
* ``tbtt``          the previous chunk's final state of the same batch slot (stop-gradient); a row resets where
                    the loader marks the start of a new document (``batch['reset']``).

Evaluation always uses the normal start (``states=None``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CARRY_STRATEGIES = ("state_passing", "tbtt")
NOISE_KEYS = ("memory", "variance")


def _is_state(x):
  return isinstance(x, dict)


def select_rows(reset, default, carried):
  """Row-wise ``where(reset, default, stop_gradient(carried))`` over every leaf (batch axis 0)."""

  def sel(d, c):
    r = reset.reshape((-1,) + (1,) * (d.ndim - 1))
    return jnp.where(r, d, jax.lax.stop_gradient(c).astype(d.dtype))

  return jax.tree.map(sel, default, carried)


def random_noise(default, key, sigma):
  out = []
  for i, st in enumerate(default):
    if st is None:
      out.append(None)
      continue
    st = dict(st)
    k = jax.random.fold_in(key, i)
    st["memory"] = sigma * jax.random.normal(k, st["memory"].shape, jnp.float32).astype(
      st["memory"].dtype
    )
    out.append(st)
  return out


def _head_reduce(x):
  """Mean and variance over every axis but the head axis (1): shape [H]."""
  axes = tuple(a for a in range(x.ndim) if a != 1)
  x = x.astype(jnp.float32)
  return jnp.mean(x, axes), jnp.var(x, axes)


def _transform(key, x):
  return (
    jnp.log(jnp.maximum(x.astype(jnp.float32), 1e-12))
    if key == "variance"
    else x.astype(jnp.float32)
  )


def init_fitted_stats(default):
  """Zero statistics with the right structure, from a (possibly abstract) default state list."""
  stats = []
  for st in default:
    if st is None:
      stats.append(None)
      continue
    stats.append(
      {
        k: {
          "mean": jnp.zeros((st[k].shape[1],), jnp.float32),
          "var": jnp.zeros((st[k].shape[1],), jnp.float32),
        }
        for k in NOISE_KEYS
        if k in st
      }
    )
  return {"count": jnp.zeros((), jnp.int32), "layers": stats}


def update_fitted_stats(stats, final_states, beta):
  """``stat <- (1 - beta) * current + beta * previous`` per layer and head; the first update copies."""
  first = stats["count"] == 0
  w_prev = jnp.where(first, 0.0, beta)
  new_layers = []
  for st_stats, fin in zip(stats["layers"], final_states):
    if st_stats is None:
      new_layers.append(None)
      continue
    layer = {}
    for k, s in st_stats.items():
      mean, var = _head_reduce(_transform(k, jax.lax.stop_gradient(fin[k])))
      layer[k] = {
        "mean": (1 - w_prev) * mean + w_prev * s["mean"],
        "var": (1 - w_prev) * var + w_prev * s["var"],
      }
    new_layers.append(layer)
  return {"count": stats["count"] + 1, "layers": new_layers}


def sample_fitted(default, stats, key):
  """iid samples per element from each head's N(mean, var); variance is sampled in log space."""
  out = []
  for i, (st, s) in enumerate(zip(default, stats["layers"])):
    if st is None:
      out.append(None)
      continue
    st = dict(st)
    for j, k in enumerate(NOISE_KEYS):
      if k not in s:
        continue
      x = st[k]
      shape_h = (1, x.shape[1]) + (1,) * (x.ndim - 2)
      z = jax.random.normal(jax.random.fold_in(key, 2 * i + j), x.shape, jnp.float32)
      smp = s[k]["mean"].reshape(shape_h) + jnp.sqrt(s[k]["var"]).reshape(shape_h) * z
      if k == "variance":
        smp = jnp.exp(smp)
      st[k] = jnp.where(stats["count"] > 0, smp.astype(x.dtype), x)
    out.append(st)
  return out


def initial_states(
  strategy, default, *, key=None, carry=None, reset=None, stats=None, sigma=0.0, reset_prob=0.0
):
  """Returns (initial states, reset mask or None) for one training step."""
  if strategy == "zero":
    return default, None
  if strategy == "random_noise":
    return random_noise(default, key, sigma), None
  if strategy == "fitted_noise":
    return sample_fitted(default, stats, key), None
  if strategy == "state_passing":
    batch = jax.tree.leaves(default)[0].shape[0]
    drawn = jax.random.bernoulli(key, reset_prob, (batch,))
    reset = drawn if reset is None else jnp.logical_or(drawn, reset)
    return select_rows(reset, default, carry), reset
  if strategy == "tbtt":
    return select_rows(reset, default, carry), reset
  raise ValueError(f"unknown initial_state strategy {strategy!r}")
