"""pallas_kernels.kdn: the gain and the delta rule under one custom VJP with the decay cumsum in
the gain kernels (DeltaRuleConfig.cumsum_in_gain), CPU interpret mode.

Held to the float64 token loop (values, final states, every gradient, through ops.diag_kdn /
iso_kdn with the option on) and to the separate ops it replaces (with and without the gate
front-end), with packed segments, T not a multiple of any chunk, T = 1 and the forward-only
chunk. The tests that reach it through the ops run with the delta rule's own cumsum kernels
patched to raise (the `composite` fixture), so a silent fallback cannot pass; the others call
pallas_kernels.kdn.kdn itself.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ops_cases
from ops_cases import make_inputs, make_state, oracle, rel_err, round_f32
from test_ops_grad import B, H, K, T, V, _arrays, _loss_fn, _oracle_loss
import pallas_kernels
from pallas_kernels import kdn as pallas_kdn
from pallas_kernels import kdn_gain
from pallas_kernels.delta_rule import chunk_cumsum, chunk_length, forward_only
from pallas_kernels.delta_rule import config as dr_config


@pytest.fixture
def composite(monkeypatch):
  """cumsum_in_gain on; the delta rule's cumsum kernels fail if anything still calls them."""
  def refuse(*args, **kwargs):
    raise AssertionError("the delta rule's own cumsum kernel ran under cumsum_in_gain")
  monkeypatch.setattr(chunk_cumsum, "chunk_cumsum", refuse)
  monkeypatch.setattr(chunk_cumsum, "chunk_reverse_cumsum", refuse)
  with dr_config.overridden(cumsum_in_gain=True):
    yield


def _segments():
  s = np.zeros((B, T), np.int32)
  s[0, 20:] = 1
  s[1, 9:30], s[1, 30:] = 1, 2
  return jnp.asarray(s)


@pytest.mark.parametrize("family,segmented", [("diag", True), ("iso", True), ("diag", False)])
def test_grads_match_token_loop(composite, family, segmented):
  """ops.diag_kdn / iso_kdn on the pallas path, every gradient (inputs, initial state,
  info_scale) against autodiff of the float64 token loop, as tests/test_ops_grad.py holds the
  separate kernels."""
  del composite
  x = round_f32(make_inputs(family, B, T, H, K, V, seed=11))
  state = round_f32(dict(enumerate(make_state(family, B, H, K, V))))
  names, arrays = _arrays(family, x, [state[i] for i in sorted(state)], H, K)
  seg = _segments() if segmented else None
  argnums = tuple(range(len(arrays)))
  got = jax.grad(_loss_fn(family, "pallas", seg), argnums)(
      *(jnp.asarray(a, jnp.float32) for a in arrays))
  with jax.enable_x64(True):
    want = jax.grad(_oracle_loss(family, seg, K), argnums)(
        *(jnp.asarray(a, jnp.float64) for a in arrays))
  for name, g, w in zip(names, got, want):
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, np.asarray(w)) <= 1e-4, (name, rel_err(g, np.asarray(w)))


def _run(family, c, mu, state, segment_ids, chunk_size=16):   # its own jit: its own traces
  return ops_cases._run(family, c, mu, state, segment_ids, "pallas", chunk_size)   # pylint: disable=protected-access


_run_jit = jax.jit(_run, static_argnums=0)


@pytest.mark.parametrize("family", ["diag", "iso"])
@pytest.mark.parametrize("case,t", [("plain", 1), ("hard_reset", 97), ("strong_decay", 97),
                                    ("tiny_r", 97), ("mu_4k", 97)])
def test_forward_edge_cases_match_token_loop(composite, family, case, t):
  """Values and final states (memory, variance) against the float64 token loop: T = 1, and
  test_ops_forward's edge cases at T = 97 (one trace per family serves them)."""
  del composite
  kw = dict(plain={}, hard_reset=dict(la_value=-1e4), strong_decay=dict(la_value=-20.0),
            tiny_r=dict(r=1e-4), mu_4k=dict(mu=4.0 * K))[case]
  x = round_f32(make_inputs(family, B, t, H, K, V, seed=7, **kw))
  state = round_f32(dict(enumerate(make_state(family, B, H, K, V))))
  state = tuple(state[i] for i in sorted(state))
  c = {key: jnp.asarray(val, jnp.float32) for key, val in x.items() if key != "mu"}
  o, final = _run_jit(family, c, x["mu"], tuple(jnp.asarray(s, jnp.float32) for s in state),
                      None)
  want_o, want_final = oracle(family, x, state=state)
  assert rel_err(o, want_o) <= 2e-5, rel_err(o, want_o)
  for got, want in zip(final, want_final):
    assert rel_err(got, want) <= 2e-5, rel_err(got, want)


def test_forward_only_chunk(composite):
  """A call that is not differentiated under DeltaRuleConfig.forward_only_chunk = 32 (chunk_size
  64; differentiated calls keep chunk 16): the gain emits g in 32-token pieces for the chunk-32
  forward (a gain chunk that holds both), with segments, against the token loop."""
  del composite
  family = "diag"
  x = round_f32(make_inputs(family, B, T, H, K, V, seed=3))
  c = {key: jnp.asarray(val, jnp.float32) for key, val in x.items() if key != "mu"}
  seg = _segments()
  with dr_config.overridden(forward_only_chunk=32) as cfg:
    assert forward_only(cfg, 64, T, True)[1] == 32 != chunk_length(cfg, 64, T, True)
    o, final = _run(family, c, x["mu"], None, seg, chunk_size=64)
  want_o, want_final = oracle(family, x, segment_ids=seg)
  assert rel_err(o, want_o) <= 2e-5
  for got, want in zip(final, want_final):
    assert rel_err(got, want) <= 2e-5


R_MIN = 0.01


def _front_inputs(diag, t, dtype, seed=0):
  """Inputs of the gate front-end path: projections in `dtype` ('bf16->f32': rounded to bf16,
  then held in fp32), parameters and states in fp32, packed segments."""
  b, h, kd, vd = 2, 2, 16, 32
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.normal(size=s)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  if dtype == "bf16->f32":
    proj = lambda x: f32(x).astype(jnp.bfloat16).astype(jnp.float32)
  else:
    proj = lambda x: f32(x).astype(dtype)
  q, k, v = proj(n(b, t, h, kd) / 4), proj(n(b, t, h, kd) / 4), proj(n(b, t, h, vd))
  gate = (proj(n(b, t, h, kd)),                                                 # f
          f32(np.log(np.expm1(rng.uniform(1e-3, 1e-1, size=(h, kd))))),        # dt_bias
          f32(np.log(rng.uniform(1, 16, size=(h,)))),                           # a_log
          proj(n(*((b, t, h, kd) if diag else (b, t, h))) - 2.0),               # omega_raw
          proj(n(b, t, h)))                                                     # r_raw
  mu = f32(np.linspace(0.5, 2.0, h) * kd)
  p0 = f32(0.1 + np.abs(n(*((b, h, kd) if diag else (b, h)))))
  h0 = f32(0.3 * n(b, h, kd, vd))
  seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 16 + [2] * (t - 21)], 2, 0), jnp.int32)
  return (q, k, v, gate, mu, p0, h0), seg


def _separate(diag, q, k, v, gate, mu, p0, h0, seg):
  """What the layer runs with the option off: the fused-front gain, then the delta rule."""
  fn = kdn_gain.diag_gain_fused if diag else kdn_gain.iso_gain_fused
  gain, la, pfin = fn(k, *gate, R_MIN, mu, p0, seg)
  w = gain if diag else gain[..., None] * k.astype(jnp.float32)
  precision = pallas_kernels.precision_for(q.dtype)
  o, sfin = pallas_kernels.delta_rule(q, k, v, la, w, q.shape[-1] ** -0.5, h0, seg,
                                      chunk_size=16, precision=precision)
  return o, sfin, pfin


def _composite(diag, q, k, v, gate, mu, p0, h0, seg):
  return pallas_kdn.kdn(q, k, v, gate, mu, p0, h0, seg, diag=diag, scale=q.shape[-1] ** -0.5,
                        r_min=R_MIN, chunk_size=16)


def _front_run(fn, diag, t, dtype):
  """(outputs, (loss, gradients of every input)) of fn, a cotangent on every output."""
  args, seg = _front_inputs(diag, t, dtype)

  def loss(*args):
    outs = fn(diag, *args, seg)
    rng = np.random.default_rng(1)
    return sum(jnp.sum(o.astype(jnp.float32) * rng.normal(size=o.shape).astype(np.float32))
               for o in outs)

  return fn(diag, *args, seg), jax.value_and_grad(loss, argnums=tuple(range(7)))(*args)


def _errors(got, want):
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves(want)
  return {jax.tree_util.keystr(p): rel_err(g, w) for (p, g), w in zip(flat_got, flat_want)}


@pytest.mark.parametrize("diag", [True, False])
def test_front_matches_separate_ops(diag):
  """With the gate front-end (the KDN layers' fused path), fp32: outputs, final states and the
  gradients of every input against the separate ops (T = 37: not a multiple of any chunk)."""
  errs = _errors(_front_run(_composite, diag, 37, jnp.float32),
                 _front_run(_separate, diag, 37, jnp.float32))
  assert not {k: e for k, e in errs.items() if not e <= 1e-6}, errs


def test_front_bf16_as_accurate_as_separate_ops():
  """bf16 projections (the layer's compute dtype), iso: both paths against the separate ops in
  fp32 on the same (bf16-rounded) values. The separate ops round each op's share of dk to bf16
  before adding them, the composite adds in fp32 and rounds once: it must be about as close to
  fp32 as they are, and within the bf16 bound."""
  ref = _front_run(_separate, False, 20, "bf16->f32")
  err_got = _errors(_front_run(_composite, False, 20, jnp.bfloat16), ref)
  err_sep = _errors(_front_run(_separate, False, 20, jnp.bfloat16), ref)
  worse = {k: (err_got[k], err_sep[k]) for k in err_got
           if not err_got[k] <= 1.25 * err_sep[k] + 1e-4}
  assert not worse, worse
  assert max(err_got.values()) <= 5e-3, err_got


def test_layer_takes_the_composite(monkeypatch):
  """KDNMixer's fused path calls pallas_kernels.kdn under the option, and its forward matches
  the layer without it."""
  from kdn_jax.layers import MIXERS   # pylint: disable=g-import-not-at-top
  from kdn_jax.models.config import model_config   # pylint: disable=g-import-not-at-top
  cfg = model_config('tiny', mixer='kdn_iso', d_model=32, num_heads=2, head_dim=16,
                     impl='pallas', chunk_size=16)
  layer = MIXERS['kdn_iso'](cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 19, 32)), jnp.float32)
  want, want_state = layer(x)
  calls = []
  real = pallas_kdn.kdn
  monkeypatch.setattr(pallas_kdn, "kdn", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  with dr_config.overridden(cumsum_in_gain=True):
    got, got_state = layer(x)
  assert calls
  assert rel_err(got, want) <= 1e-6
  for name in ("memory", "variance"):
    assert rel_err(got_state[name], want_state[name]) <= 1e-6, name


def test_bad_arguments_raise():
  (q, k, v, gate, mu, p0, h0), _ = _front_inputs(True, 20, jnp.float32)
  with pytest.raises(ValueError, match="gate has 3 arrays"):
    pallas_kdn.kdn(q, k, v, gate[:3], mu, p0, h0, diag=True, scale=0.25, r_min=R_MIN)
  with pytest.raises(ValueError, match="r_min must be > 0"):
    pallas_kdn.kdn(q, k, v, gate, mu, p0, h0, diag=True, scale=0.25, r_min=0.0)
  with pytest.raises(ValueError, match="omega_raw has shape"):
    pallas_kdn.kdn(q, k, v, gate[:3] + (gate[3][..., 0],) + gate[4:], mu, p0, h0, diag=True,
                   scale=0.25, r_min=R_MIN)
  with pytest.raises(ValueError, match="p0 has shape"):
    pallas_kdn.kdn(q, k, v, gate, mu, p0[..., :3], h0, diag=True, scale=0.25, r_min=R_MIN)
  from pallas_kernels.kdn_gain import config as gain_config   # pylint: disable=g-import-not-at-top
  old = gain_config.DEFAULT
  gain_config.set_default(num_warps=2)
  try:
    with pytest.raises(ValueError, match="GainConfig.num_warps must be 1"):
      pallas_kdn.kdn(q, k, v, gate, mu, p0, h0, diag=True, scale=0.25, r_min=R_MIN)
  finally:
    gain_config.DEFAULT = old
