"""Tests of kdn_jax.layers: every mixer's chunked forward vs step decode (outputs and final state),
packed segments vs separate sequences, state continuation, KDN options, sharding metadata, dtypes.
Tiny shapes, CPU; each mixer's checks share one jitted program to keep compile time down."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdn_jax.layers import LOGICAL_AXES, MIXERS, ShortConv, is_recurrent, logical_axis_rules
from kdn_jax.layers.kdn_mixer import KDNMixer
from kdn_jax.models.config import model_config

RECURRENT = [m for m in MIXERS if is_recurrent(m)]
ATOL = 2e-4
T = 12
LENS = (4, 4, 4)  # packed segments (sum = T); equal lengths so the separate runs batch


def _cfg(mixer, **kw):
  kw.setdefault("swa_window", 4)
  kw.setdefault("chunk_size", 4)  # several chunks per sequence
  return model_config("tiny", mixer=mixer, **kw)


@functools.cache
def _cached(name, items):
  return nnx.jit(lambda: MIXERS[name](_cfg(name, **dict(items)), rngs=nnx.Rngs(0)))()


def _mixer(name, fresh=False, **kw):
  """Shared (read-only) mixer instance; fresh=True for tests that mutate parameters."""
  m = _cached(name, tuple(sorted(kw.items())))
  return nnx.clone(m) if fresh else m


def _x(B, T_, d=64, seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T_, d), jnp.float32)


def _random_state(mixer, batch, seed=2):
  """A non-trivial state with the mixer's structure (positive variance); numpy RNG (no compiles)."""
  st = mixer.init_state(batch)
  leaves, tdef = jax.tree.flatten_with_path(st)
  rng = np.random.default_rng(seed)
  out = []
  for path, leaf in leaves:
    if "variance" in jax.tree_util.keystr(path):
      out.append(jnp.asarray(rng.uniform(0.2, 2.0, leaf.shape), jnp.float32))
    else:
      out.append(jnp.asarray(0.3 * rng.standard_normal(leaf.shape), jnp.float32))
  return jax.tree.unflatten(tdef, out)


def _close(a, b, atol=ATOL, what=""):
  def f(u, v):
    np.testing.assert_allclose(
      np.asarray(u, np.float32), np.asarray(v, np.float32), atol=atol, rtol=1e-3, err_msg=what
    )

  jax.tree.map(f, a, b)


def _decode(mixer, x, state):
  """Token-by-token decode with mixer.step inside a lax.scan."""

  def body(s, x_t):
    y, s = mixer.step(x_t, s)
    return s, y

  state, ys = jax.lax.scan(body, state, jnp.moveaxis(x, 1, 0))
  return jnp.moveaxis(ys, 0, 1), state


@nnx.jit
def _fwd(mixer, x, state, segment_ids=None):
  return mixer(x, initial_state=state, segment_ids=segment_ids)


@nnx.jit
def _recurrent_checks(mixer, x, st0, x1):
  """Everything one recurrent mixer is checked on, in one compiled program."""
  out = {}
  out["fwd"] = mixer(x, initial_state=st0)
  out["dec"] = _decode(mixer, x, st0)
  ya, sa = mixer(x[:, : T // 2], initial_state=st0)
  yb, sb = mixer(x[:, T // 2 :], initial_state=sa)
  out["cont"] = (jnp.concatenate([ya, yb], 1), sb)
  seg = jnp.asarray(np.repeat(np.arange(len(LENS)), LENS)[None], jnp.int32)
  st1 = jax.tree.map(lambda a: a[:1], st0)
  out["packed"] = mixer(x1, initial_state=st1, segment_ids=seg)
  n = len(LENS)
  ys, ss = mixer(
    x1.reshape(n, T // n, -1), initial_state=jax.tree.map(lambda a: jnp.repeat(a, n, 0), st1)
  )
  out["separate"] = (ys.reshape(1, T, -1), jax.tree.map(lambda a: a[-1:], ss))
  return out


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_mixer(name):
  mixer = _mixer(name)
  x, x1 = _x(2, T), _x(1, T, seed=3)
  st0 = _random_state(mixer, 2)
  out = _recurrent_checks(mixer, x, st0, x1)
  y, fs = out["fwd"]
  assert y.shape == x.shape
  expected = {"memory", "variance", "conv"} if isinstance(mixer, KDNMixer) else {"memory", "conv"}
  assert set(fs) == expected and set(fs["conv"]) == {"q", "k", "v"}
  assert fs["memory"].shape == (2, 2, 32, 32) and fs["memory"].dtype == jnp.float32
  assert jax.tree.structure(fs) == jax.tree.structure(mixer.init_state(2))
  _close(out["fwd"], out["dec"], what="parallel vs step decode (given state)")
  _close(out["fwd"], out["cont"], what="initial-state continuation")
  _close(out["packed"], out["separate"], what="packed segments vs separate sequences")


def test_faithful_mamba2_mixer():
  """Mamba-2's own block (raw B, C, scale 1, gated RMSNorm over the heads): the same contract."""
  mixer = _mixer("mamba2", mamba2_variant="faithful")
  assert mixer.faithful and not mixer.normalize_qk and mixer.scale == 1.0
  x, x1 = _x(2, T), _x(1, T, seed=3)
  out = _recurrent_checks(mixer, x, _random_state(mixer, 2), x1)
  _close(out["fwd"], out["dec"], what="parallel vs step decode (given state)")
  _close(out["fwd"], out["cont"], what="initial-state continuation")
  _close(out["packed"], out["separate"], what="packed segments vs separate sequences")


def test_official_mamba2_mixer():
  """mamba_ssm's Mamba2 block (layers/mamba2_official.py): the same contract, its own conv cache."""
  mixer = _mixer("mamba2", mamba2_variant="official")
  x, x1 = _x(2, T), _x(1, T, seed=3)
  out = _recurrent_checks(mixer, x, _random_state(mixer, 2), x1)
  fs = out["fwd"][1]
  assert set(fs) == {"memory", "conv"} and set(fs["conv"]) == {"xBC"}
  assert fs["memory"].shape == (2, 2, 128, 64) and fs["conv"]["xBC"].shape == (2, 3, 384)
  _close(out["fwd"], out["dec"], what="parallel vs step decode (given state)")
  _close(out["fwd"], out["cont"], what="initial-state continuation")
  _close(out["packed"], out["separate"], what="packed segments vs separate sequences")


@nnx.jit
def _attention_checks(mixer, x, x1):
  out = {"fwd": mixer(x)[0]}
  cache = mixer.init_cache(x.shape[0], T + 4)
  yp, cache = mixer.prefill(x[:, :5], cache)
  yd, cache = _decode(mixer, x[:, 5:], cache)
  out["dec"] = jnp.concatenate([yp, yd], 1)
  out["index"] = cache["index"]
  seg = jnp.asarray(np.repeat(np.arange(len(LENS)), LENS)[None], jnp.int32)
  out["packed"] = mixer(x1, segment_ids=seg)[0]
  n = len(LENS)
  out["separate"] = mixer(x1.reshape(n, T // n, -1))[0].reshape(1, T, -1)
  return out


@pytest.mark.parametrize("name", ["attention", "swa"])
def test_attention_mixer(name):
  mixer = _mixer(name)
  assert mixer.init_state(2) is None
  out = _attention_checks(mixer, _x(2, T), _x(1, T, seed=3))
  _close(out["fwd"], out["dec"], what="full forward vs prefill + KV-cache decode")
  assert int(out["index"]) == T
  _close(out["packed"], out["separate"], what="packed segments vs separate sequences")
  y, st = _fwd(mixer, _x(2, T), None)
  assert st is None
  with pytest.raises(ValueError):
    mixer(_x(1, 2), initial_state={"memory": 0})


def test_swa_window_is_local():
  full, swa = _mixer("attention"), _mixer("swa", fresh=True, swa_window=3)
  nnx.update(swa, nnx.state(full))
  x = _x(1, T)
  y_swa, _ = _fwd(swa, x, None)
  y_full, _ = _fwd(full, x, None)
  _close(y_swa[:, :3], y_full[:, :3])  # inside the window the two agree
  y2, _ = _fwd(swa, x.at[:, 0].add(1.0), None)  # token 0 is out of reach for t >= 3
  _close(y2[:, 3:], y_swa[:, 3:], atol=1e-6)
  assert not np.allclose(y2[:, 2], y_swa[:, 2])


def test_short_conv_segments_and_cache():
  conv = ShortConv((3,), 4, names=("kv",), rngs=nnx.Rngs(0))
  x = _x(2, 9, 3)
  cache = 0.5 * jax.random.normal(jax.random.key(4), (2, 3, 3))
  y, c = conv(x, cache)
  ys, cs = [], cache
  for t in range(9):
    yt, cs = conv.step(x[:, t], cs)
    ys.append(yt)
  _close(y, jnp.stack(ys, 1), atol=1e-6)
  _close(c, cs, atol=1e-6)
  seg = jnp.asarray(
    [[0] * 4 + [1] * 5] * 2, jnp.int32
  )  # second segment restarts from the given cache
  yp, cp = conv(x, cache, seg)
  y1, _ = conv(x[:, :4], cache)
  y2, c2 = conv(x[:, 4:], cache)
  _close(yp, jnp.concatenate([y1, y2], 1), atol=1e-6)
  _close(cp, c2, atol=1e-6)
  seg = jnp.asarray([[0] * 8 + [1]] * 2, jnp.int32)  # last segment shorter than the window
  _, cp = conv(x, cache, seg)
  _, c1 = conv(x[:, 8:], cache)
  _close(cp, c1, atol=1e-6)


def test_kdn_default_state_uses_learned_variance():
  m = _mixer("kdn_diag", fresh=True)
  st = m.init_state(3)
  np.testing.assert_allclose(st["variance"], 1.0, rtol=1e-6)
  assert st["variance"].shape == (3, 2, 32)
  m.variance_raw[...] = jnp.asarray([-30.0, 2.0])
  st = m.init_state(1)
  np.testing.assert_allclose(st["variance"][0, 0], 0.1, rtol=1e-5)  # floor
  np.testing.assert_allclose(st["variance"][0, 1], 0.1 + math.log1p(math.exp(2.0)), rtol=1e-5)
  assert _mixer("kdn_iso").init_state(3)["variance"].shape == (3, 2)


@pytest.mark.parametrize("name", ["kdn_diag", "kdn_iso"])
def test_learned_info_scale_trainable_positive_init_k(name):
  m = _mixer(name, fresh=True, info_scale="learned", impl="reference")  # cheap to differentiate
  np.testing.assert_allclose(m.info_scale(), 32.0, rtol=1e-5)  # K = head_dim = 32
  assert m.log_info_scale[...].shape == (2,)
  x = _x(2, 8)

  def loss(model):
    y, fs = model(x)
    return jnp.sum(y**2) + jnp.sum(fs["variance"])

  g = nnx.jit(nnx.grad(loss))(m)
  assert float(jnp.abs(g["log_info_scale"][...]).sum()) > 0
  m.log_info_scale[...] = jnp.asarray([-50.0, 50.0])
  assert bool(jnp.all(m.info_scale() > 0))


@pytest.mark.parametrize(
  "info,expect", [("1", 1.0), ("sqrt_k", math.sqrt(32)), ("k", 32.0), ("4k", 128.0), (2.5, 2.5)]
)
def test_fixed_info_scales(info, expect):
  m = nnx.eval_shape(
    lambda: MIXERS["kdn_diag"](_cfg("kdn_diag", info_scale=info), rngs=nnx.Rngs(0))
  )
  assert m.info_scale() == pytest.approx(expect)
  assert m.log_info_scale is None


@nnx.jit
def _noise(m, x):
  return m.noise_params(x)


@pytest.mark.parametrize("name", ["kdn_diag", "kdn_iso"])
@pytest.mark.parametrize("noise", ["learned", "fixed_r", "fixed"])
def test_noise_modes(name, noise):
  m = _mixer(name, noise=noise)
  x = _x(2, 7)
  omega, r = _noise(m, x)
  assert omega.shape == ((2, 7, 2, 32) if name == "kdn_diag" else (2, 7, 2)) and r.shape == (
    2,
    7,
    2,
  )
  if noise == "learned":
    assert bool(jnp.all(r >= 0.01)) and bool(jnp.all(omega >= 0))
    assert float(jnp.std(r)) > 0
    assert m.r_proj is not None and m.omega_proj is not None
  else:
    np.testing.assert_array_equal(r, 1.0)
    assert m.r_proj is None
    if noise == "fixed":
      np.testing.assert_array_equal(omega, 1.0)
      assert m.omega_proj is None
    else:
      assert m.omega_proj is not None


def test_r_floor():
  m = _mixer("kdn_diag", fresh=True)
  m.r_proj.bias[...] = jnp.full((2,), -100.0)
  _, r = _noise(m, _x(1, 3))
  np.testing.assert_allclose(r, 0.01, rtol=1e-4)


@pytest.mark.parametrize("name", list(MIXERS))
def test_sharding_metadata(name):
  m = nnx.eval_shape(lambda: MIXERS[name](_cfg(name), rngs=nnx.Rngs(0)))
  params = nnx.state(m, nnx.Param)
  for path, v in jax.tree_util.tree_leaves_with_path(
    params, is_leaf=lambda z: isinstance(z, nnx.Variable)
  ):
    names = v.get_metadata()["out_sharding"]
    assert len(names) == len(v.shape), (path, names, v.shape)
    assert all(n in LOGICAL_AXES for n in names), (path, names)
  with nnx.logical_axis_rules(logical_axis_rules()):
    specs = nnx.get_partition_spec(params)
  q = specs["q_proj"]["kernel"]
  q = q.get_value() if hasattr(q, "get_value") else q
  assert tuple(q) == ("fsdp", "tensor", None)


@pytest.mark.parametrize("name", ["kdn_diag", "swa"])
def test_bf16_compute_fp32_params(name):
  m = _mixer(name, dtype="bfloat16")
  for v in jax.tree.leaves(nnx.state(m, nnx.Param)):
    assert v.dtype == jnp.float32
  y, fs = _fwd(m, _x(2, 8).astype(jnp.bfloat16), None)
  assert y.dtype == jnp.bfloat16
  y32, _ = _fwd(_mixer(name), _x(2, 8), None)
  np.testing.assert_allclose(np.asarray(y, np.float32), y32, atol=5e-2, rtol=5e-2)
  if fs is not None:
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(fs))


def test_swa_decode_cache_is_a_window_sized_ring():
  """swa decodes from a cache of `window` slots (O(window) memory), still equal to the parallel form
  after the ring has wrapped several times; full attention keeps a max_len cache."""
  swa = _mixer("swa", fresh=True, swa_window=3)
  cache = swa.init_cache(2, 100)
  assert cache["k"].shape[1] == 3 and _mixer("attention").init_cache(2, 100)["k"].shape[1] == 100
  x = jax.random.normal(jax.random.key(7), (2, 11, swa.d_model), jnp.float32)
  y_par, _ = swa(x)
  y_pre, cache = swa.prefill(x[:, :5], cache)  # prefill longer than the ring
  ys = [y_pre]
  for t in range(5, 11):
    y_t, cache = swa.step(x[:, t], cache)
    ys.append(y_t[:, None])
  _close(jnp.concatenate(ys, 1), y_par)
  assert sorted(np.asarray(cache["pos"]).tolist()) == [8, 9, 10]


def test_full_attention_cache_overflow_is_loud():
  """Decoding past the full-attention cache's max_len gives NaN, not clamped writes; a prefill
  longer than the cache is refused while tracing."""
  att = _mixer("attention")
  x = _x(1, 6)
  cache = att.init_cache(1, 4)
  y, cache = att.prefill(x[:, :4], cache)
  assert np.isfinite(np.asarray(y)).all()
  y5, _ = att.step(x[:, 4], cache)
  assert np.isnan(np.asarray(y5)).all()
  with pytest.raises(ValueError, match="max_len=4"):
    att.prefill(x[:, :6], att.init_cache(1, 4))


def _dot_operand_dtypes(jaxpr):
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      out.append(tuple(str(v.aval.dtype) for v in e.invars))
    for p in e.params.values():
      inner = getattr(p, "jaxpr", None)
      if inner is not None:
        out += _dot_operand_dtypes(getattr(inner, "jaxpr", inner))
  return out


def test_bf16_dense_backward_runs_bf16_matmuls_close_to_float32():
  """A bf16 Dense's backward must not promote its matmuls to float32 (TF32 GEMMs on GPU, 13.9 ms of a KDN
  layer's 56 ms at 16k); its gradients stay within bf16 rounding of the float32 layer's."""
  from kdn_jax.layers.dense import Dense

  x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 32))
  grads, dots = {}, {}
  for dt in (jnp.float32, jnp.bfloat16):
    layer = Dense(32, (2, 8), ("embed", "heads", "kv"), use_bias=True, dtype=dt, rngs=nnx.Rngs(0))
    gd, params = nnx.split(layer)

    def loss(p, x):
      return jnp.sum(jnp.sin(nnx.merge(gd, p)(x).astype(jnp.float32)))

    fn = jax.grad(loss, argnums=(0, 1))
    dots[dt] = _dot_operand_dtypes(jax.make_jaxpr(fn)(params, x).jaxpr)
    grads[dt] = fn(params, x)
  assert dots[jnp.bfloat16] and all(d == ("bfloat16", "bfloat16") for d in dots[jnp.bfloat16]), dots
  assert all(d == ("float32", "float32") for d in dots[jnp.float32]), dots
  for a, b in zip(jax.tree.leaves(grads[jnp.bfloat16]), jax.tree.leaves(grads[jnp.float32])):
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b), atol=3e-2 * float(np.abs(b).max())
    )


def test_bf16_dense_without_bias_returns_the_gemms_bf16_output():
  """A bf16 Dense without bias asks its matmul for bf16 (float32 accumulation, one rounding), not
  a float32 result cast in a second pass over the output; its values are the float32 result
  rounded, up to the summation order (one bf16 ulp on a few elements)."""
  from kdn_jax.layers.dense import Dense

  x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 256))
  layer = Dense(256, (2, 64), ("embed", "heads", "kv"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  jaxpr = jax.make_jaxpr(layer)(x).jaxpr
  outs = []

  def walk(j):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        outs.append(str(e.outvars[0].aval.dtype))
      for p in e.params.values():
        inner = getattr(p, "jaxpr", None)
        if inner is not None:
          walk(getattr(inner, "jaxpr", inner))

  walk(jaxpr)
  assert outs == ["bfloat16"], outs
  y = layer(x)
  w = layer.kernel[...].astype(jnp.bfloat16).astype(jnp.float32)
  ref = jnp.einsum("btd,dhk->bthk", x.astype(jnp.bfloat16).astype(jnp.float32), w)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(y, np.float32),
    np.asarray(ref.astype(jnp.bfloat16), np.float32),
    rtol=1e-2,
    atol=1e-2,
  )
  with pytest.raises(ValueError, match="out_dtype"):
    from kdn_jax.layers.dense import project

    project(
      x.astype(jnp.bfloat16),
      layer.kernel[...].astype(jnp.bfloat16),
      ((2,), (0,)),
      out_dtype=jnp.float16,
    )


def test_grouped_value_heads_equal_tied_query_key_heads():
  """num_heads=1, num_v_heads=2 (grouped value heads, layers/recurrent.py) is the two-head layer
  whose q and k projections and convs are the one head's, repeated: the same outputs and final
  memory and variance, in the parallel forward and in step decode; q/k parameters and conv
  caches once."""
  name = "kdn_diag"
  grouped = MIXERS[name](_cfg(name, num_heads=1, num_v_heads=2), rngs=nnx.Rngs(0))
  tied = MIXERS[name](_cfg(name, num_heads=2), rngs=nnx.Rngs(1))
  g_params, t_params = nnx.state(grouped, nnx.Param), nnx.state(tied, nnx.Param)
  repeated = []

  def tie(g, t):
    if g.shape == t.shape:
      return g
    repeated.append(g.shape)
    axis = next(i for i, (a, b) in enumerate(zip(g.shape, t.shape)) if a != b)
    assert t.shape[axis] == 2 * g.shape[axis], (g.shape, t.shape)
    return jnp.repeat(g, 2, axis=axis)

  nnx.update(tied, jax.tree.map(tie, g_params, t_params))
  assert len(repeated) == 4, repeated  # q_proj, k_proj, q_conv, k_conv (no biases)
  x = _x(2, T)
  st_g, st_t = grouped.init_state(2), tied.init_state(2)
  assert st_g["conv"]["k"].shape[2] == 1 and st_g["memory"].shape == st_t["memory"].shape
  (y_g, s_g), (y_t, s_t) = (_fwd(m, x, st) for m, st in ((grouped, st_g), (tied, st_t)))
  (d_g, e_g), (d_t, e_t) = (nnx.jit(_decode)(m, x, st) for m, st in ((grouped, st_g), (tied, st_t)))
  assert float(jnp.std(y_g)) > 1e-3
  for got, want, what in ((y_g, y_t, "output"), (d_g, d_t, "decoded output"), (d_g, y_g, "decode")):
    _close(got, want, what=what)
  for s_a, s_b in ((s_g, s_t), (e_g, e_t)):
    _close(
      {n: s_a[n] for n in ("memory", "variance")},
      {n: s_b[n] for n in ("memory", "variance")},
      what="final state",
    )


@pytest.mark.parametrize("name", ["kdn_diag", "kda"])  # (iso: the op tests)
def test_pallas_layer_decodes_with_the_fused_step(name):
  """A layer built with impl='pallas' decodes through the fused decode kernel (interpret mode
  here) and matches the same layer decoding with the XLA step; 'reference' never reaches it."""
  fused, ref = _mixer(name, impl="pallas"), _mixer(name, impl="reference")
  x, st0 = _x(2, 3), _random_state(ref, 2)
  step_jaxpr = lambda m: str(jax.make_jaxpr(lambda x_t, s: m.step(x_t, s))(x[:, 0], st0))
  assert "decode_step_" in step_jaxpr(fused) and "decode_step_" not in step_jaxpr(ref)
  _close(nnx.jit(_decode)(fused, x, st0), nnx.jit(_decode)(ref, x, st0), what="fused vs XLA step")
