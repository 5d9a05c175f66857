"""Tests of kdn_jax.models: prefill + decode == forward, state continuation, generation, config
validation, parameter matching across mixers for every size (abstractly, nothing materialised),
dtypes/sharding metadata, and a tiny model learning a repetition task on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kdn_jax.layers import LOGICAL_AXES, MIXERS
from kdn_jax.models import LanguageModel, generate, model_config, param_count
from kdn_jax.models.config import SIZES, analytic_non_embedding, layer_mixers

T = 12


def _build(cfg, seed=0):
  # Eager: the initialisers' small ops compile once per shape and are reused by every model of the
  # file (a jitted constructor compiles a whole new program per config).
  return LanguageModel(cfg, rngs=nnx.Rngs(seed))


def _tokens(B, T_, vocab, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T_), 0, vocab, jnp.int32)


@nnx.jit
def _lm_checks(model, tokens):
  B, T_ = tokens.shape
  out = {"full": model(tokens)}
  cache = model.init_cache(B, T_ + 2)
  lp, cache = model.prefill(tokens[:, :5], cache)

  def body(c, tok):
    lg, c = model.decode_step(tok, c)
    return c, lg

  cache, ld = jax.lax.scan(body, cache, tokens[:, 5:].T)
  out["decoded"] = jnp.concatenate([lp, jnp.moveaxis(ld, 0, 1)], 1)
  if all(st is not None for st in model.init_states(1)):  # attention carries nothing across chunks
    la, sa = model(tokens[:, : T_ // 2], states=model.init_states(B))
    lb, sb = model(tokens[:, T_ // 2 :], states=sa)
    out["chunked"] = (jnp.concatenate([la, lb], 1), sb)
  return out


@pytest.mark.parametrize("pattern", ["kdn_diag,swa", "gdn2,attention", "kdn_iso,gla"])
def test_prefill_decode_and_states_match_forward(pattern):
  cfg = model_config(
    "tiny",
    layer_pattern=pattern,
    swa_window=4,
    chunk_size=4,
    tie_embeddings=pattern.startswith("kdn"),
  )
  model = _build(cfg)
  tokens = _tokens(2, T, cfg.vocab_size)
  out = _lm_checks(model, tokens)
  logits, states = out["full"]
  assert logits.shape == (2, T, cfg.vocab_size) and logits.dtype == jnp.float32
  assert len(states) == cfg.num_layers
  for name, st in zip(layer_mixers(cfg), states):
    assert (st is None) == (name in ("swa", "attention"))
  np.testing.assert_allclose(out["decoded"], logits, atol=2e-4, rtol=1e-3)
  if "chunked" in out:
    np.testing.assert_allclose(out["chunked"][0], logits, atol=2e-4, rtol=1e-3)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-3), out["chunked"][1], states
    )
  else:
    assert "swa" in pattern or "attention" in pattern


def test_init_states_normal_start():
  cfg = model_config("tiny", layer_pattern="kdn_diag,kdn_iso,swa", num_layers=3)
  model = _build(cfg)
  states = model.init_states(2)
  assert states[2] is None
  np.testing.assert_allclose(states[0]["variance"], 1.0)
  assert states[0]["variance"].shape == (2, 2, 32) and states[1]["variance"].shape == (2, 2)
  model.blocks[0].mixer.variance_raw[...] = jnp.asarray([0.5, 3.0])
  v = model.init_states(1)[0]["variance"]
  assert v[0, 0, 0] != v[0, 1, 0]  # default variance comes from the learned params


@functools.cache
def _gen_model():
  cfg = model_config("tiny", layer_pattern="kdn_diag,swa", swa_window=4, chunk_size=4)
  return cfg, _build(cfg, seed=1)


def test_generate_greedy_matches_forward():
  cfg, model = _gen_model()
  prompt = _tokens(2, 5, cfg.vocab_size, seed=3)
  out = generate(model, prompt, 6)
  assert out.shape == (2, 11) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :5], prompt)
  logits, _ = nnx.jit(lambda m, t: m(t))(model, out)
  np.testing.assert_array_equal(out[:, 5:], jnp.argmax(logits[:, 4:-1], -1))


def test_generate_sampling():
  cfg, model = _gen_model()
  prompt = _tokens(2, 5, cfg.vocab_size, seed=3)
  greedy = generate(model, prompt, 6)
  top1 = generate(model, prompt, 6, temperature=1.0, top_k=1, rng=jax.random.key(0))
  np.testing.assert_array_equal(top1, greedy)
  s1 = generate(model, prompt, 6, temperature=1.0, top_k=1000, rng=jax.random.key(1))
  assert s1.shape == (2, 11) and bool(jnp.all((s1 >= 0) & (s1 < cfg.vocab_size)))
  with pytest.raises(ValueError):
    generate(model, prompt, 2, temperature=1.0)


# ------------------------------------------------------------------------------------ configs ----
def test_config_info_scale_text_is_the_layers_reading():
  """model_config keeps info_scale as the one parser reads it: a number (as number or text) as
  repr(float), a name in lower case; the layer's mu follows from that text."""
  from kdn_jax.layers.kdn_mixer import info_scale_text, resolve_info_scale

  for given, kept in (
    (0.5, "0.5"),
    (" 5E-1 ", "0.5"),
    ("K", "k"),
    (2, "2.0"),
    ("Learned", "learned"),
  ):
    assert model_config("tiny", info_scale=given).info_scale == kept
    assert info_scale_text(kept) == kept
  assert resolve_info_scale("SQRT_K", 16) == 4.0
  with pytest.raises(ValueError, match="info_scale"):
    resolve_info_scale("-1", 16)


def test_config_validation_names_the_key():
  cases = [
    (dict(mixer="nope"), "mixer"),
    (dict(layer_pattern="kdn_diag,bogus"), "layer_pattern"),
    (dict(info_scale="huge"), "info_scale"),
    (dict(noise="loud"), "noise"),
    (dict(dtype="float64"), "dtype"),
    (dict(r_min=0.0), "r_min"),
    (dict(num_layers=0), "num_layers"),
    (dict(chunk_size=24), "chunk_size"),
    (dict(num_v_heads=3), "num_v_heads"),  # (tiny: num_heads 2)
    (dict(num_v_heads=-2), "num_v_heads"),
    (dict(not_a_key=1), "not_a_key"),
  ]
  for overrides, key in cases:
    with pytest.raises(ValueError, match=repr(key)):
      model_config("tiny", **overrides)
  with pytest.raises(ValueError, match="size"):
    model_config("3b")


def test_layer_pattern():
  cfg = model_config("1.3b", layer_pattern="kdn_diag,swa")
  names = layer_mixers(cfg)
  assert len(names) == 18 and names.count("kdn_diag") == 9 and names.count("swa") == 9
  assert layer_mixers(model_config("tiny", mixer="gla")) == ["gla", "gla"]
  assert model_config("750m").num_layers == 16 and model_config("750m").d_model == 2048
  assert model_config("1.3b").num_heads * model_config("1.3b").head_dim == 18 * 128


VARIANTS = [dict(mixer=m) for m in MIXERS] + [
  dict(layer_pattern="kdn_diag,swa"),
  dict(layer_pattern="kdn_iso,attention"),
  dict(layer_pattern="gated_deltanet,gated_deltanet,swa"),
  dict(noise="fixed"),
  dict(noise="fixed_r"),
  dict(info_scale="learned"),
  dict(mixer="kdn_iso", noise="fixed"),
]


@pytest.mark.parametrize("size", list(SIZES))
def test_parameter_matching_within_1pct(size):
  ref = analytic_non_embedding(model_config(size))
  for v in VARIANTS:
    n = analytic_non_embedding(model_config(size, **v))
    assert abs(n - ref) / ref < 0.01, (size, v, n, ref)


@pytest.mark.parametrize(
  "size,mixer",
  [
    ("tiny", "kdn_diag"),
    ("tiny", "swa"),
    ("20m", "gdn2"),
    ("1.3b", "kdn_diag"),
    ("1.3b", "attention"),
  ],
)
def test_param_count_helper_matches_model(size, mixer):
  cfg = model_config(size, mixer=mixer)
  counts = param_count(cfg)  # nnx.eval_shape: nothing is materialised
  assert counts["non_embedding"] == analytic_non_embedding(cfg)
  assert counts["embedding"] == cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  assert counts["total"] == counts["embedding"] + counts["mixer"] + counts["mlp"] + counts["norm"]
  if size == "1.3b":
    assert 1.1e9 < counts["total"] < 1.5e9


def test_lm_sharding_and_dtypes_abstract():
  cfg = model_config("tiny", layer_pattern="kdn_diag,swa", dtype="bfloat16", tie_embeddings=False)
  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  for path, v in jax.tree_util.tree_leaves_with_path(
    params, is_leaf=lambda z: isinstance(z, nnx.Variable)
  ):
    names = v.get_metadata()["out_sharding"]
    assert len(names) == len(v.shape) and all(n in LOGICAL_AXES for n in names), (path, names)
    assert v.dtype == jnp.float32
  assert params["embed"].get_metadata()["out_sharding"] == ("vocab", "embed")
  assert params["lm_head"]["kernel"].get_metadata()["out_sharding"] == ("embed", "vocab")
  graphdef, state = nnx.split(model)
  logits, states = jax.eval_shape(
    lambda s, t: nnx.merge(graphdef, s)(t), state, jax.ShapeDtypeStruct((2, 8), jnp.int32)
  )
  assert logits.dtype == jnp.float32 and logits.shape == (2, 8, cfg.vocab_size)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(states))


# ------------------------------------------------------------------------------------ training ---
@pytest.mark.usefixtures("optimized_xla")
def test_tiny_model_learns_repetition():
  # The chunked op under a repeated jitted train step: this once deadlocked XLA:CPU (its batched
  # triangular solve); the op now inverts with matmuls only.
  cfg = model_config("tiny", mixer="kdn_diag", vocab_size=32, chunk_size=16, impl="chunked")
  model = _build(cfg)
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  P, R, B = 8, 4, 16  # random pattern of 8 tokens repeated 4 times

  def batch(key):
    pat = jax.random.randint(key, (B, P), 0, cfg.vocab_size, jnp.int32)
    return jnp.tile(pat, (1, R))

  def loss_fn(m, tokens):
    logits, _ = m(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return ce[:, P:].mean()  # the predictable part

  @nnx.jit
  def train_step(m, o, key):
    loss, grads = nnx.value_and_grad(loss_fn)(m, batch(key))
    o.update(m, grads)
    return loss

  keys = jax.random.split(jax.random.key(0), 300)
  losses = [float(train_step(model, opt, k)) for k in keys]
  first, last = np.mean(losses[:10]), np.mean(losses[-10:])
  assert last < 0.5 * first, (first, last)


def test_scan_layers_matches_unrolled(pattern="kdn_diag,swa", num_layers=4):
  """scan_layers (one compiled layer body) == the unrolled loop: logits, final states, gradients,
  from carried states, on a repeating recurrent + attention pattern; a pattern that
  does not repeat (or repeats once) falls back to the loop."""
  from kdn_jax.models import layer_scan

  for other, n in (("kdn_iso,kda,swa", 3), ("", 1)):
    assert not layer_scan.can_scan(
      layer_mixers(model_config("tiny", layer_pattern=other, num_layers=n)), None
    )
  cfg = model_config("tiny", mixer="kdn_diag", layer_pattern=pattern, num_layers=num_layers)
  names = layer_mixers(cfg)
  assert layer_scan.can_scan(names, None) == (num_layers // layer_scan.pattern_period(names) >= 2)
  model = _build(cfg)
  gd, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = _tokens(2, T, cfg.vocab_size)
  states0 = nnx.jit(lambda m, t: m(t)[1])(
    model, tokens
  )  # one compile, not an eager op-by-op forward

  def run(params, scan, states):
    m = nnx.merge(gd, params, rest)
    m.scan_layers = scan
    logits, st = m(tokens, states=states)
    return jnp.mean(logits**2) + 1e-3 * sum(jnp.sum(x**2) for x in jax.tree.leaves(st)), (
      logits,
      st,
    )

  for states in (states0,):  # carried states (None takes the same layer code from init_states)
    outs = [
      jax.jit(jax.value_and_grad(functools.partial(run, scan=s, states=states), has_aux=True))(
        params
      )
      for s in (False, True)
    ]
    (_, (l0, s0)), g0 = outs[0]
    (_, (l1, s1)), g1 = outs[1]
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(s1) == jax.tree.structure(s0)
    for a, b in zip(
      jax.tree.leaves(s1) + jax.tree.leaves(g1), jax.tree.leaves(s0) + jax.tree.leaves(g0)
    ):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * (1 + float(jnp.max(jnp.abs(b)))))


def test_mixer_override_after_model_config_keeps_params_matched():
  """Editing the mixer after model_config (as --config.model.mixer=... does) re-matches the MLP width;
  an explicitly set mlp_hidden is kept."""
  from kdn_jax.models.config import effective_mlp_hidden

  ref = param_count(model_config("20m", mixer="kdn_diag"))["non_embedding"]
  for mixer in ("gla", "swa", "deltanet"):
    cfg = model_config("20m", mixer="kdn_diag")
    cfg.mixer = mixer
    direct = model_config("20m", mixer=mixer)
    assert effective_mlp_hidden(cfg) == direct.mlp_hidden != model_config("20m").mlp_hidden
    assert abs(param_count(cfg)["non_embedding"] - ref) / ref < 0.01
  cfg = model_config("20m", mixer="kdn_diag")
  cfg.mixer, cfg.mlp_hidden = "gla", 640
  assert effective_mlp_hidden(cfg) == 640
  # a frozen config builds too, and the runner's write-back makes the config show the real width
  import ml_collections

  from kdn_jax.models.config import resolve_mlp_hidden

  cfg = model_config("tiny", mixer="kdn_diag")
  cfg.mixer = "gla"
  frozen = nnx.eval_shape(
    lambda: LanguageModel(ml_collections.FrozenConfigDict(cfg), rngs=nnx.Rngs(0))
  )
  assert resolve_mlp_hidden(cfg) == model_config("tiny", mixer="gla").mlp_hidden == cfg.mlp_hidden
  assert frozen.blocks[0].mlp.up.kernel.shape[-1] == cfg.mlp_hidden
  assert effective_mlp_hidden(cfg) == cfg.mlp_hidden  # idempotent after the write-back
  with pytest.raises(ValueError, match="scan_layers"):
    model_config("tiny", scan_layers="yes")
