"""Tests of the Mamba-2 mixer (kdn_jax.layers.mamba2): the recurrence against a float64 token loop,
parameter matching, and a tiny LM forward + grad. Chunked forward == step decode and packed segments ==
separate sequences are checked for mamba2 by tests/layers/test_layers.py (test_recurrent_mixer runs every
recurrent mixer). Tiny shapes, CPU, a few compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kdn_jax.layers import MIXERS, Mamba2
from kdn_jax.layers.short_conv import l2_normalize
from kdn_jax.models import LanguageModel, model_config
from kdn_jax.models.config import analytic_non_embedding

T = 12


def _mixer(impl="chunked"):
  cfg = model_config("tiny", mixer="mamba2", chunk_size=4, impl=impl)
  return nnx.jit(lambda: Mamba2(cfg, rngs=nnx.Rngs(0)))()


def _x(B, T_, seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T_, 64), jnp.float32)


def _random_state(m, batch, seed=2):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), jnp.float32), m.init_state(batch)
  )


@nnx.jit
def _core_inputs(m, x):
  conv = m.init_state(x.shape[0])["conv"]
  q, _ = m.q_conv(m.q_proj(x), conv["q"])
  k, _ = m.k_conv(m.k_proj(x), conv["k"])
  v, _ = m.v_conv(m.v_proj(x), conv["v"])
  return l2_normalize(q), l2_normalize(k), v, m._gates(x), m.decay(x)


@nnx.jit
def _core(m, q, k, v, gates, s0):
  return m._core(q, k, v, gates, {"memory": s0}, None)


def test_recurrence_matches_float64_loop():
  m = _mixer()
  x = _x(2, T, seed=5)
  q, k, v, gates, g_call = _core_inputs(m, x)
  np.testing.assert_array_equal(gates["g"], g_call)  # Decay.__call__ unchanged
  assert gates["g"].shape == gates["dt"].shape == (2, T, 2)
  A = np.exp(np.asarray(m.decay.A_log[...], np.float64))
  np.testing.assert_allclose(gates["g"], -A * np.asarray(gates["dt"], np.float64), rtol=1e-6)
  s0 = _random_state(m, 2)["memory"]

  # float64 token loop: S_t = alpha_t S_{t-1} + dt_t k_t v_t^T, o_t = scale S_t^T q_t + D v_t
  qd, kd, vd = (np.asarray(a, np.float64) for a in (q, k, v))
  alpha, dt = np.exp(np.asarray(gates["g"], np.float64)), np.asarray(gates["dt"], np.float64)
  D = np.asarray(m.D[...], np.float64)
  S = np.asarray(s0, np.float64)
  ref = np.zeros(vd.shape)
  for t in range(T):
    S = (
      alpha[:, t, :, None, None] * S
      + dt[:, t, :, None, None] * kd[:, t, :, :, None] * vd[:, t, :, None, :]
    )
    ref[:, t] = m.scale * np.einsum("bhkv,bhk->bhv", S, qd[:, t]) + D[:, None] * vd[:, t]
  assert m.scale == 32.0

  for impl in ("reference", "chunked"):
    m.impl = impl
    o, st = _core(m, q, k, v, gates, s0)
    np.testing.assert_allclose(o, ref, atol=2e-4, rtol=1e-4, err_msg=impl)
    np.testing.assert_allclose(st["memory"], S, atol=2e-5, rtol=1e-4, err_msg=impl)
  # the skip D v is part of the output (zero D removes exactly that term)
  m.D[...] = jnp.zeros_like(m.D[...])
  o0, _ = _core(m, q, k, v, gates, s0)
  np.testing.assert_allclose(o0, ref - D[:, None] * vd, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("size", ["tiny", "125m"])
def test_parameter_matched_to_kdn_diag(size):
  ref = analytic_non_embedding(model_config(size))
  n = analytic_non_embedding(model_config(size, mixer="mamba2"))
  assert abs(n - ref) / ref < 0.01, (size, n, ref)
  assert "mamba2" in MIXERS


def test_tiny_lm_forward_and_grad():
  cfg = model_config("tiny", mixer="mamba2", chunk_size=4, impl="chunked", num_layers=1)
  model = nnx.jit(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))()
  tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, cfg.vocab_size, jnp.int32)

  def loss_fn(mdl):
    logits, _ = mdl(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
  assert np.isfinite(float(loss))
  leaves = jax.tree.leaves(grads)
  assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  mixer_grads = grads["blocks"][0]["mixer"]
  for name in ("A_log", "dt_bias"):
    assert float(jnp.abs(mixer_grads["decay"][name][...]).sum()) > 0, name
  assert float(jnp.abs(mixer_grads["D"][...]).sum()) > 0


# ---- the faithful variant (mamba2_variant='faithful'): Mamba-2's own block --------------------
def _faithful():
  cfg = model_config("tiny", mixer="mamba2", mamba2_variant="faithful", chunk_size=4)
  return nnx.jit(lambda: Mamba2(cfg, rngs=nnx.Rngs(0)))()


@nnx.jit
def _faithful_inputs(m, x):
  """(q, k, v after conv + SiLU, unnormalised; gates; z) as the mixer computes them."""
  conv = m.init_state(x.shape[0])["conv"]
  q, _ = m.q_conv(m.q_proj(x), conv["q"])
  k, _ = m.k_conv(m.k_proj(x), conv["k"])
  v, _ = m.v_conv(m.v_proj(x), conv["v"])
  return q, k, v, m._gates(x), m.z_proj(x)


def _faithful_loop(q, k, v, g, dt, z, D, w, s0, eps):
  """Token loop of Mamba-2 (ngroups = H): h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,
  y_t = C_t^T h_t + D x_t, out_t = RMSNorm_{H*V}(y_t * SiLU(z_t)) * w. jnp, so it runs in float64
  under enable_x64 and differentiates."""
  S, ys = s0, []
  for t in range(q.shape[1]):
    S = jnp.exp(g[:, t])[..., None, None] * S + (
      dt[:, t, :, None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
    )
    o = jnp.einsum("bhkv,bhk->bhv", S, q[:, t]) + D[:, None] * v[:, t]
    y = o * jax.nn.silu(z[:, t])
    y = y / jnp.sqrt(jnp.mean(y * y, axis=(-2, -1), keepdims=True) + eps) * w
    ys.append(y)
  return jnp.stack(ys, 1), S


def test_faithful_matches_float64_loop():
  m = _faithful()
  assert m.scale == 1.0 and not m.normalize_qk
  x = _x(2, T, seed=5)
  q, k, v, gates, z = _faithful_inputs(m, x)
  # B and C are the conv outputs as they are (no L2 normalisation)
  assert np.abs(np.linalg.norm(np.asarray(k), axis=-1) - 1.0).max() > 0.1
  s0 = _random_state(m, 2)["memory"]
  D, w = m.D[...], m.norm_weight[...]
  cot = np.random.default_rng(3).standard_normal((2, T, 2, 32))
  inputs = (q, k, v, gates["g"], gates["dt"], z)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (*inputs, D, w, s0)]
    ref_y, ref_S = _faithful_loop(*a64, eps=m.eps)

    def ref_loss(*a):
      return jnp.sum(_faithful_loop(*a, *a64[6:], eps=m.eps)[0] * cot)

    ref_grads = jax.grad(ref_loss, argnums=tuple(range(6)))(*a64[:6])
    ref_y, ref_S = np.asarray(ref_y), np.asarray(ref_S)
    ref_grads = [np.asarray(g_) for g_ in ref_grads]

  def tail(q_, k_, v_, g_, dt_, z_):
    o, st = m._core(q_, k_, v_, {"g": g_, "dt": dt_}, {"memory": s0}, None)
    return m.gated_norm(o, z_), st["memory"]

  for impl in ("reference", "chunked"):
    m.impl = impl
    y, S = jax.jit(tail)(*inputs)
    np.testing.assert_allclose(y, ref_y, atol=2e-4, rtol=1e-4, err_msg=impl)
    np.testing.assert_allclose(S, ref_S, atol=2e-5, rtol=1e-4, err_msg=impl)
    grads = jax.jit(
      jax.grad(lambda *a: jnp.sum(tail(*a)[0] * cot.astype(np.float32)), argnums=tuple(range(6)))
    )(*inputs)
    for name, got, want in zip(("q", "k", "v", "g", "dt", "z"), grads, ref_grads):
      scale = np.abs(want).max()
      np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=2e-3, err_msg=f"{impl} d{name}")
  # the whole mixer: the same output through o_proj, from the zero conv cache
  m.impl = "chunked"
  state = dict(m.init_state(2), memory=s0)
  y_full, st = nnx.jit(lambda mm, xx, s: mm(xx, initial_state=s))(m, x, state)
  want = nnx.jit(lambda mm, yy: mm.o_proj(yy))(m, jnp.asarray(ref_y, jnp.float32))
  np.testing.assert_allclose(y_full, want, atol=2e-4, rtol=1e-3)
  np.testing.assert_allclose(st["memory"], ref_S, atol=2e-5, rtol=1e-4)


def test_normalized_stays_the_default():
  cfg = model_config("tiny", mixer="mamba2")
  assert cfg.mamba2_variant == "normalized"
  m = _mixer()
  assert m.normalize_qk and m.scale == float(cfg.head_dim) and hasattr(m, "g_proj")
