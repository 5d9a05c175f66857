"""Gradients of every op and impl, the initial state included, against
autodiff of the float64 token loop; plus numerical checks on tiny shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import kdn_oracle
from ops_cases import FAMILIES, make_inputs, make_state, rel_err, round_f32
from kdn_jax import ops

B, T, H, K, V = 2, 45, 2, 16, 8


def _arg_names(family):
  base = ["q", "k", "v", "log_alpha"]
  if family in ("diag", "iso"):
    return base + ["omega", "r", "memory", "variance"]
  return base + ["write", "memory"]


def _loss_fn(family, impl, segment_ids, mu):
  """Scalar loss of (inputs..., state...) touching outputs and final state."""

  def loss(*args):
    kw = dict(impl=impl, output_final_state=True, segment_ids=segment_ids,
              chunk_size=16)
    if family in ("diag", "iso"):
      q, k, v, la, om, r, mem, var = args
      fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
      o, st = fn(q, k, v, la, om, r, info_scale=mu,
                 initial_state=ops.KDNState(mem, var), **kw)
      final = (st.memory, st.variance)
    else:
      q, k, v, la, w, mem = args
      o, s = ops.delta_rule(q, k, v, la, w, initial_state=mem, **kw)
      final = (s,)
    return _weighted(o, final)

  return loss


def _weighted(o, final):
  # Fixed, position-dependent weights so every output element matters.
  total = jnp.sum(jnp.sin(jnp.arange(o.size).reshape(o.shape)) * o)
  for i, f in enumerate(final):
    total += jnp.sum(jnp.cos(jnp.arange(f.size).reshape(f.shape) + i) * f)
  return total


def _oracle_loss(family, segment_ids, mu):
  scale = K ** -0.5

  def loss(*args):
    if family in ("diag", "iso"):
      q, k, v, la, om, r, mem, var = args
      o, s, p = kdn_oracle.kdn(q, k, v, la, om, r, mem, var, mu, scale,
                               family == "diag", segment_ids)
      return _weighted(o, (s, p))
    q, k, v, la, w, mem = args
    o, s = kdn_oracle.delta_rule(q, k, v, la, w, mem, scale, segment_ids)
    return _weighted(o, (s,))

  return loss


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_grads_match_token_loop(family, impl, segmented):
  x = round_f32(make_inputs(family, B, T, H, K, V, seed=11))
  state = round_f32(dict(enumerate(make_state(family, B, H, K, V))))
  names = _arg_names(family)
  arrays = [x[n] for n in names if n in x] + [state[i] for i in
                                              sorted(state)]
  seg = None
  if segmented:
    s = np.zeros((B, T), np.int32)
    s[0, 20:] = 1
    s[1, 9:30], s[1, 30:] = 1, 2
    seg = jnp.asarray(s)
  argnums = tuple(range(len(arrays)))
  got = jax.grad(_loss_fn(family, impl, seg, x.get("mu")), argnums)(
      *(jnp.asarray(a, jnp.float32) for a in arrays))
  with jax.enable_x64(True):
    want = jax.grad(_oracle_loss(family, seg, x.get("mu")), argnums)(
        *(jnp.asarray(a, jnp.float64) for a in arrays))
    want = [np.asarray(w) for w in want]
  for name, g, w in zip(names, got, want):
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, w) <= 1e-4, (name, rel_err(g, w))


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_check_grads_numerically(family, impl):
  b, t, h, kd, vd = 1, 5, 1, 4, 3
  with jax.enable_x64(True):
    x = make_inputs(family, b, t, h, kd, vd, seed=12)
    state = make_state(family, b, h, kd, vd)
    names = _arg_names(family)
    arrays = [jnp.asarray(x[n]) for n in names if n in x] + [
        jnp.asarray(s) for s in state]
    seg = jnp.asarray([[0, 0, 1, 1, 1]])
    check_grads(_loss_fn(family, impl, seg, x.get("mu")), arrays, order=1,
                modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


def test_info_scale_gradient_through_array():
  """A per-head mu passed as an array gets a gradient (learned info_scale)."""
  x = make_inputs("diag", 1, 20, H, K, V, seed=13)
  c = {k: jnp.asarray(v, jnp.float32) for k, v in x.items() if k != "mu"}

  def loss(mu):
    o, _ = ops.diag_kdn(c["q"], c["k"], c["v"], c["log_alpha"], c["omega"],
                        c["r"], info_scale=mu, impl="chunked")
    return jnp.sum(o ** 2)

  g = jax.grad(loss)(jnp.full((H,), float(K)))
  assert g.shape == (H,) and np.all(np.isfinite(g)) and np.any(g != 0)
