"""Probes of a model's recurrence: KDN's effective write strength (beta_eff, the KDN paper's Fig. 2) and
statistics of the carried states (memory, KDN variance) per layer, each head's memory norm, and
each head's time constant from its decay parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BETA_BINS = np.linspace(0.0, 1.0, 51)


def _kdn_layers(model) -> list[int]:
  return [i for i, blk in enumerate(model.blocks) if hasattr(blk.mixer, "write_strength")]


def write_strengths(model, tokens, segment_ids=None) -> dict[int, np.ndarray]:
  """{layer index: beta_eff [B, T, H]} for every KDN layer of ``model`` on ``tokens`` [B, T]."""
  layers = _kdn_layers(model)
  if not layers:
    return {}
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, seg):
    m = nnx.merge(graphdef, state)
    xs = m.mixer_inputs(tokens, segment_ids=seg)
    return {i: m.blocks[i].mixer.write_strength(xs[i], segment_ids=seg) for i in layers}

  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return {i: np.asarray(v) for i, v in run(state, jnp.asarray(tokens, jnp.int32), seg).items()}


def beta_summary(betas: dict[int, np.ndarray], mask=None) -> dict:
  """Per-layer and overall mean / quantiles / histogram of beta_eff (positions where ``mask`` [B, T])."""

  def summ(x):
    hist, _ = np.histogram(x, bins=BETA_BINS)
    return {
      "mean": float(np.mean(x)),
      "std": float(np.std(x)),
      "median": float(np.median(x)),
      "p05": float(np.quantile(x, 0.05)),
      "p95": float(np.quantile(x, 0.95)),
      "count": int(x.size),
      "hist": hist.tolist(),
    }

  vals = {}
  for i, b in betas.items():
    sel = b if mask is None else b[np.asarray(mask, bool)]
    vals[i] = np.asarray(sel, np.float64).ravel()
  out = {"bins": BETA_BINS.tolist(), "layers": {str(i): summ(v) for i, v in vals.items()}}
  if vals:
    out["all"] = summ(np.concatenate(list(vals.values())))
  return out


@jax.jit
def _state_stats(cache):
  out = []
  for layer in cache:
    if not isinstance(layer, dict) or "memory" not in layer:
      out.append(None)
      continue
    m = layer["memory"].astype(jnp.float32)
    st = {
      "memory_mean": jnp.mean(m),
      "memory_std": jnp.std(m),
      "memory_norm": jnp.mean(jnp.sqrt(jnp.sum(m * m, axis=(-2, -1)))),
    }  # per (batch, head)
    if "variance" in layer:
      v = layer["variance"].astype(jnp.float32)
      st.update(
        variance_mean=jnp.mean(v),
        variance_std=jnp.std(v),
        variance_min=jnp.min(v),
        variance_max=jnp.max(v),
      )
    out.append(st)
  return out


def state_stats(cache) -> list[dict | None]:
  """Per layer: mean / std of the memory entries and mean Frobenius norm per (sequence, head); KDN
  variance mean / std / min / max. None for layers without a recurrent state (attention)."""
  return [None if s is None else {k: float(v) for k, v in s.items()} for s in _state_stats(cache)]


@jax.jit
def _head_norms(cache):
  return [
    jnp.sqrt(jnp.sum(jnp.square(layer["memory"].astype(jnp.float32)), axis=(-2, -1)))
    if isinstance(layer, dict) and "memory" in layer
    else None
    for layer in cache
  ]


def head_norms(cache) -> list[np.ndarray | None]:
  """Per layer: each row's and head's memory Frobenius norm [B, H]; None for layers without a
  recurrent state."""
  return [None if s is None else np.asarray(s, np.float64) for s in _head_norms(cache)]


def time_constants(model) -> list[dict]:
  """Per layer with a decay (an ``A_log`` beside a ``dt_bias``): each head's time constant in
  tokens at zero input, tau = 1 / (exp(A_log) softplus(dt_bias)) (the decay exp(-1/tau) per token
  when the data-dependent part of dt is 0; Mamba-2's dt projection and GLA / KDN's low-rank f add
  to dt_bias). A per-channel decay (dt_bias [H, K]) gives the median and the longest over the
  head's channels."""
  found: dict[tuple, dict] = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] in ("A_log", "dt_bias"):
      found.setdefault(tuple(path[:-1]), {})[path[-1]] = np.asarray(var.get_value(), np.float64)
  out = []
  for where, p in sorted(found.items(), key=lambda kv: [str(x) for x in kv[0]]):
    if len(p) != 2:
      continue
    a = np.exp(p["A_log"])
    dt = np.logaddexp(0.0, p["dt_bias"])  # softplus
    tau = 1.0 / (a.reshape(a.shape + (1,) * (dt.ndim - 1)) * dt)
    tau = tau.reshape(len(a), -1)
    out.append(
      {
        "path": "/".join(str(x) for x in where),
        "tau_median": np.median(tau, axis=1).tolist(),
        "tau_max": tau.max(axis=1).tolist(),
      }
    )
  return out
