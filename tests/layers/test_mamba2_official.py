"""Tests of mamba_ssm's Mamba2 block and LM (mamba2_variant='official', layers/mamba2_official.py):
the block against a float64 token loop written from the equations (outputs, final state, input
gradients; T = 1 and ragged T; zero and given initial state; the decode step), its parameter count
against mamba_ssm's formula, the initialisation, the weight-decay mask and the LM around it. The
state contract (packed segments, continuation) is checked with every mixer in test_layers.py.
Tiny shapes, CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import schema
from experiments.runner.optim import decay_mask, path_str
from kdn_jax.layers import MIXERS, Mamba2Official
from kdn_jax.models import LanguageModel, model_config
from kdn_jax.models.config import ModelConfigError, analytic_non_embedding, effective_mlp_hidden
from kdn_jax.models.param_counts import param_count

D_MODEL = 64  # d_inner 128: two heads of 64, d_state 128


def _cfg(**kw):
  kw.setdefault("chunk_size", 4)  # several chunks in the ragged sequences
  return model_config("tiny", mixer="mamba2", mamba2_variant="official", **kw)


@functools.cache
def _block(impl="chunked"):
  m = nnx.jit(lambda: MIXERS["mamba2"](_cfg(impl=impl), rngs=nnx.Rngs(0)))()
  assert isinstance(m, Mamba2Official)
  return m


def _x(B, T, seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D_MODEL), jnp.float32)


def _random_state(m, batch, seed=2):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), jnp.float32), m.init_state(batch)
  )


def _params(m):
  """The block's parameters as float64 arrays (in_proj [d, 2E + 2N + H], conv [W, E + 2N])."""
  names = ("in_proj", "conv_w", "conv_b", "dt_bias", "A_log", "D", "norm_w", "out_proj")
  vals = (
    m.in_proj.kernel,
    m.conv.weight,
    m.conv.bias,
    m.dt_bias,
    m.A_log,
    m.D,
    m.norm_weight,
    m.out_proj.kernel,
  )
  return {n: jnp.asarray(np.asarray(v[...]), jnp.float64) for n, v in zip(names, vals)}


def _loop(p, u, h0, conv0, *, E=128, N=128, P=64, eps=1e-5):
  """mamba_ssm's Mamba2 from its equations, one token at a time (jnp: float64 under enable_x64,
  differentiable). u [B, T, d]; h0 [B, H, N, P]; conv0 [B, W-1, E + 2N] (the last W-1 conv
  inputs, oldest first). Returns (out [B, T, d], h_T, conv_T)."""
  H = E // P
  win, h, outs = conv0, h0, []
  for t in range(u.shape[1]):
    proj = u[:, t] @ p["in_proj"]  # [z, x, B, C, dt]
    z, xbc, dt = proj[:, :E], proj[:, E : 2 * E + 2 * N], proj[:, 2 * E + 2 * N :]
    full = jnp.concatenate([win, xbc[:, None]], axis=1)  # [B, W, E + 2N], oldest first
    win = full[:, 1:]
    xbc = jax.nn.silu(jnp.sum(full * p["conv_w"][None], axis=1) + p["conv_b"])
    x = xbc[:, :E].reshape(-1, H, P)
    Bt, Ct = xbc[:, E : E + N], xbc[:, E + N :]  # one group: every head reads these
    dt = jax.nn.softplus(dt + p["dt_bias"])  # [B, H]
    A = -jnp.exp(p["A_log"])
    h = jnp.exp(dt * A)[:, :, None, None] * h + (
      dt[:, :, None, None] * Bt[:, None, :, None] * x[:, :, None, :]
    )
    y = jnp.einsum("bhnp,bn->bhp", h, Ct) + p["D"][:, None] * x
    g = (y * jax.nn.silu(z.reshape(-1, H, P))).reshape(-1, E)  # gate first, then RMSNorm over E
    g = g / jnp.sqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps) * p["norm_w"].reshape(E)
    outs.append(g @ p["out_proj"].reshape(E, -1))
  return jnp.stack(outs, 1), h, win


def _reference(m, u, state, cot):
  """(out, h_T, conv_T, d(sum out * cot)/du) of the float64 loop."""
  with jax.enable_x64(True):
    p = _params(m)
    u64, cot64 = jnp.asarray(np.asarray(u), jnp.float64), jnp.asarray(cot, jnp.float64)
    h0, c0 = (
      jnp.asarray(np.asarray(a), jnp.float64) for a in (state["memory"], state["conv"]["xBC"])
    )
    out, h, win = _loop(p, u64, h0, c0)
    du = jax.grad(lambda uu: jnp.sum(_loop(p, uu, h0, c0)[0] * cot64))(u64)
    return tuple(np.asarray(a) for a in (out, h, win, du))


@nnx.jit
def _forward_and_grad(m, u, state, cot):
  (y, st) = m(u, initial_state=state)
  du = jax.grad(lambda uu: jnp.sum(m(uu, initial_state=state)[0] * cot))(u)
  return y, st, du


@nnx.jit
def _decode(m, u, state):
  def body(s, u_t):
    y, s = m.step(u_t, s)
    return s, y

  state, ys = jax.lax.scan(body, state, jnp.moveaxis(u, 1, 0))
  return jnp.moveaxis(ys, 0, 1), state


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("given_state", [False, True])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_block_matches_float64_loop(T, given_state, impl):
  m = _block(impl)
  u = _x(2, T, seed=T)
  state = _random_state(m, 2) if given_state else m.init_state(2)
  cot = np.random.default_rng(3).standard_normal((2, T, D_MODEL))
  want_y, want_h, want_conv, want_du = _reference(m, u, state, cot)
  scale = np.abs(want_y).max()
  y, st, du = _forward_and_grad(m, u, state, jnp.asarray(cot, jnp.float32))
  np.testing.assert_allclose(y, want_y, atol=2e-4 * scale, rtol=1e-3)
  np.testing.assert_allclose(st["memory"], want_h, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(st["conv"]["xBC"], want_conv, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(du, want_du, atol=2e-4 * np.abs(want_du).max(), rtol=2e-3)
  # the decode step, token by token from the same state, is the same computation
  y_dec, st_dec = _decode(m, u, state)
  np.testing.assert_allclose(y_dec, want_y, atol=2e-4 * scale, rtol=1e-3)
  np.testing.assert_allclose(st_dec["memory"], want_h, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(st_dec["conv"]["xBC"], want_conv, atol=1e-6, rtol=1e-6)


def test_states_at_match_prefix_runs():
  m = _block()
  u, state = _x(2, 7, seed=4), _random_state(m, 2)
  _, final, at = nnx.jit(lambda mm, uu, s: mm(uu, initial_state=s, states_at=(3, 7)))(m, u, state)
  _, prefix = nnx.jit(lambda mm, uu, s: mm(uu, initial_state=s))(m, u[:, :3], state)
  for got, want in (
    (jax.tree.map(lambda a: a[:, 0], at), prefix),
    (jax.tree.map(lambda a: a[:, 1], at), final),
  ):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), got, want)


# ---- parameters ------------------------------------------------------------------------------
def official_count(
  d_model, n_layer, vocab, *, expand=2, d_state=128, headdim=64, ngroups=1, d_conv=4
):
  """mamba_ssm's Mamba2 LM (d_intermediate = 0, tied): per layer in_proj d * (2 E + 2 G N + H),
  conv (E + 2 G N) * (d_conv + 1) (weight and bias), dt_bias, A_log, D: H each, the gated norm E,
  out_proj E * d, the block's prenorm d; the embedding vocab * d (tied); the final norm d."""
  E = expand * d_model
  H = E // headdim
  layer = (
    d_model * (2 * E + 2 * ngroups * d_state + H)
    + (E + 2 * ngroups * d_state) * (d_conv + 1)
    + 3 * H
    + E
    + E * d_model
    + d_model
  )
  return {"embedding": vocab * d_model, "non_embedding": n_layer * layer + d_model}


@pytest.mark.parametrize("d_model,n_layer", [(64, 2), (96, 3)])
def test_parameter_count_is_mamba_ssm_formula(d_model, n_layer):
  cfg = _cfg(d_model=d_model, num_layers=n_layer, vocab_size=300)
  counts = param_count(cfg)
  want = official_count(d_model, n_layer, 300)
  assert counts["embedding"] == want["embedding"] and counts["mlp"] == 0
  assert counts["non_embedding"] == want["non_embedding"] == analytic_non_embedding(cfg)
  assert cfg.mlp_hidden == effective_mlp_hidden(cfg) == 0


def test_initialisation():
  L, E, d = 4, 256, 128
  cfg = _cfg(d_model=d, num_layers=L)
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  m = model.blocks[0].mixer
  assert model.blocks[0].mlp is None and model.readout_scale == 1.0
  np.testing.assert_allclose(np.std(model.embed[...]), 0.02, rtol=0.05)
  dt = np.asarray(jax.nn.softplus(m.dt_bias[...]))
  A = np.exp(np.asarray(m.A_log[...]))
  assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
  assert A.min() >= 1.0 and A.max() <= 16.0 and np.all(np.asarray(m.D[...]) == 1.0)
  # PyTorch's default U(+-fan_in^-1/2), out_proj divided by sqrt(n_layer)
  w_in, w_out = np.asarray(m.in_proj.kernel[...]), np.asarray(m.out_proj.kernel[...])
  assert np.abs(w_in).max() <= d**-0.5
  np.testing.assert_allclose(np.std(w_in), (3 * d) ** -0.5, rtol=0.03)
  assert np.abs(w_out).max() <= E**-0.5 / np.sqrt(L)
  np.testing.assert_allclose(np.std(w_out), (3 * E) ** -0.5 / np.sqrt(L), rtol=0.03)
  one_layer = LanguageModel(_cfg(d_model=d, num_layers=1), rngs=nnx.Rngs(0)).blocks[0].mixer
  np.testing.assert_allclose(np.std(one_layer.out_proj.kernel[...]) / np.std(w_out), 2.0, rtol=0.05)
  # the long-dt arm's range, floored at 1e-4 as mamba_ssm does
  long = MIXERS["mamba2"](_cfg(dt_min=1e-4, dt_max=1e-2, d_model=512), rngs=nnx.Rngs(1))
  dt = np.asarray(jax.nn.softplus(long.dt_bias[...]))
  assert dt.min() >= 1e-4 * (1 - 1e-4) and dt.max() <= 1e-2 * (1 + 1e-5) and dt.max() > 1e-3


def test_weight_decay_mask():
  model = nnx.eval_shape(lambda: LanguageModel(_cfg(), rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  mask = decay_mask(params, schema.base_config().optim.no_decay)
  flags = {
    path_str(p).removeprefix("blocks/0/mixer/").removesuffix("/value"): bool(v)
    for p, v in jax.tree_util.tree_leaves_with_path(mask)
    if path_str(p).startswith("blocks/0/mixer/")
  }
  for name in ("A_log", "D", "dt_bias"):
    assert not flags[name], name
  for name in ("in_proj/kernel", "out_proj/kernel", "conv/weight"):
    assert flags[name], name


# ---- the LM ----------------------------------------------------------------------------------
def test_lm_decode_matches_forward():
  cfg = _cfg(num_layers=2, vocab_size=64)
  model = nnx.jit(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))()
  tokens = jax.random.randint(jax.random.key(0), (2, 6), 0, 64, jnp.int32)

  @nnx.jit
  def run(mdl, toks):
    logits, _ = mdl(toks)
    h = mdl.final_norm(mdl.blocks[1](mdl.blocks[0](mdl._embed(toks))[0])[0])
    untied = h @ mdl.embed[...].T  # tied and unscaled, as mamba_ssm's lm_head

    def body(c, tok):
      lg, c = mdl.decode_step(tok, c)
      return c, lg

    _, dec = jax.lax.scan(body, mdl.init_cache(2, 6), toks.T)
    return logits, untied, jnp.moveaxis(dec, 0, 1)

  logits, untied, dec = run(model, tokens)
  np.testing.assert_allclose(logits, untied, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(dec, logits, atol=2e-4, rtol=1e-3)
  assert model.has_prefix_states()


def test_config_option_and_errors():
  c = schema.base_config()
  c.model = model_config("tiny", mixer="gla")
  assert effective_mlp_hidden(c.model) > 0
  c.model.mixer, c.model.mamba2_variant = "mamba2", "official"
  assert effective_mlp_hidden(c.model) == 0  # a flag override drops the MLP
  c.model.mixer = "gla"
  assert effective_mlp_hidden(c.model) > 0  # the variant is unused by other mixers
  with pytest.raises(ModelConfigError, match="every layer to be mamba2"):
    _cfg(layer_pattern="mamba2,swa")
  with pytest.raises(ModelConfigError, match="'d_model'.*multiple of headdim 64, got d_model = 48"):
    _cfg(d_model=48)
