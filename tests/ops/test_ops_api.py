"""Dtypes, composability (jit, vmap, grad, shard_map) and input errors."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from ops_cases import make_inputs, rel_err, run

import pallas_kernels
from kdn_jax import ops

B, T, H, K, V = 2, 40, 4, 16, 8


def _inputs(family="diag", dtype=jnp.float32, t=T):
  x = make_inputs(family, B, t, H, K, V, seed=21)
  return {k: (jnp.asarray(v, dtype) if isinstance(v, np.ndarray) else v) for k, v in x.items()}


def _diag(x, **kw):
  return ops.diag_kdn(x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], x["r"], **kw)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_bfloat16_inputs(impl):
  x = make_inputs("diag", B, T, H, K, V, seed=22)
  o16, (s16, p16) = run("diag", x, impl, dtype=jnp.bfloat16)
  o32, (s32, p32) = run("diag", x, impl, dtype=jnp.float32)
  assert o16.dtype == jnp.bfloat16
  assert s16.dtype == jnp.float32 and p16.dtype == jnp.float32
  assert rel_err(o16, o32) < 2e-2  # bf16 input rounding only


@pytest.mark.parametrize("family", ["diag", "iso"])
def test_bfloat16_inputs_pallas(family):
  """The Pallas path takes 16-bit inputs as they are (no fp32 copies; the kernels compute in
  fp32): outputs and every input's gradient (in the input's dtype) within bf16 rounding of the
  same inputs given in fp32."""
  x = make_inputs(family, B, T, H, K, 16, seed=23)  # (the kernels take V >= 16)
  names = ("q", "k", "v", "log_alpha", "omega", "r")
  fn = ops.diag_kdn if family == "diag" else ops.iso_kdn

  def loss(args, ct):
    o, st = fn(*args, info_scale=x["mu"], impl="pallas", chunk_size=16, output_final_state=True)
    return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(st.variance)

  ct = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, H, 16)), jnp.float32)
  grad = jax.jit(jax.value_and_grad(loss))
  res = {}
  for dt in (jnp.bfloat16, jnp.float32):
    # both runs from the same bf16-rounded values: only the computation's dtypes differ
    args = tuple(jnp.asarray(x[n], jnp.bfloat16).astype(dt) for n in names)
    res[dt] = grad(args, ct)
  (l16, g16), (l32, g32) = res[jnp.bfloat16], res[jnp.float32]
  assert abs(float(l16) - float(l32)) <= 1e-2 * abs(float(l32))
  for n, a, b in zip(names, g16, g32):
    assert a.dtype == jnp.bfloat16, n
    assert rel_err(a, b) < 2e-2, (n, rel_err(a, b))


def test_scalar_beta_write_is_formed_in_fp32():
  """A 16-bit beta and k give their write beta k in fp32 on the XLA paths (the kernels apply beta
  in fp32 too; on GPU a bf16 product lost ~1.7e-3 of the state against the Pallas decode step),
  and kda's XLA step then matches the same step on fp32 copies of the same inputs."""
  from kdn_jax.ops.delta_reference import scalar_write

  rng = np.random.default_rng(5)
  beta = jnp.asarray(rng.uniform(0.1, 0.9, (2, 3)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.bfloat16)
  w = scalar_write(beta, k)
  assert w.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(w), np.asarray(beta, np.float32)[..., None] * np.asarray(k, np.float32)
  )
  xs = {n: jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.bfloat16) for n in ("q", "v")}
  g = -jnp.asarray(rng.uniform(0.01, 0.1, (2, 3, 8)), jnp.bfloat16)
  mem = jnp.asarray(rng.normal(size=(2, 3, 8, 8)), jnp.float32)
  f32 = lambda a: a.astype(jnp.float32)
  step = jax.jit(ops.kda_step, static_argnames=("impl",))
  _, m16 = step(xs["q"], k, xs["v"], g, beta, mem, impl="reference")
  _, m32 = step(f32(xs["q"]), f32(k), f32(xs["v"]), f32(g), f32(beta), mem, impl="reference")
  assert rel_err(m16, m32) < 1e-6


def test_float64_under_x64():
  with jax.enable_x64(True):
    x = _inputs(dtype=jnp.float64)
    o, st = _diag(x, impl="chunked", output_final_state=True)
    assert o.dtype == jnp.float64 and st.memory.dtype == jnp.float64


def test_jit_vmap_grad_compose():
  x = _inputs()
  f = lambda q: _diag(dict(x, q=q), impl="chunked")[0]
  want = f(x["q"])
  np.testing.assert_allclose(jax.jit(f)(x["q"]), want, rtol=1e-6, atol=1e-6)
  # vmap over an extra leading axis equals a Python loop.
  qs = jnp.stack([x["q"], 2 * x["q"]])
  got = jax.vmap(f)(qs)
  np.testing.assert_allclose(got[1], f(2 * x["q"]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
  # The jitted gradient against the token loop's (held to the float64 oracle
  # in test_ops_grad).
  loss = lambda impl: lambda q: jnp.sum(_diag(dict(x, q=q), impl=impl)[0] ** 2)
  g = jax.jit(jax.grad(loss("chunked")))(x["q"])
  assert rel_err(g, jax.grad(loss("reference"))(x["q"])) <= 1e-5


@pytest.mark.parametrize("axis", ["heads", "batch"])
def test_shard_map(axis):
  devices = np.array(jax.devices()[:2])
  if len(devices) < 2:
    pytest.fail("tests need >= 2 devices (conftest sets 8 CPU devices)")
  mesh = Mesh(devices, ("x",))
  x = _inputs()
  spec4 = P(None, None, "x", None) if axis == "heads" else P("x")
  spec3 = P(None, None, "x") if axis == "heads" else P("x")
  specs = tuple(spec3 if n == "r" else spec4 for n in ("q", "k", "v", "log_alpha", "omega", "r"))

  def body(q, k, v, la, om, r):
    # Per-device heads get their own info_scale slice only if mu is per head;
    # a float mu is the same everywhere.
    return ops.diag_kdn(q, k, v, la, om, r, info_scale=float(K), impl="chunked")[0]

  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec4))
  args = [x[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
  np.testing.assert_allclose(sharded(*args), _diag(x, impl="chunked")[0], rtol=1e-5, atol=1e-6)


BAD_INPUTS = [
  (lambda x: _diag(dict(x, q=x["q"][0])), ValueError, "q must have rank 4"),
  (lambda x: _diag(dict(x, k=x["k"][:, :-1])), ValueError, "k must have shape"),
  (lambda x: _diag(dict(x, v=x["v"][:1])), ValueError, "v must have shape"),
  (lambda x: _diag(dict(x, r=x["r"][..., :2])), ValueError, "r must have shape"),
  (lambda x: _diag(dict(x, omega=x["omega"][..., 0])), ValueError, "omega must have shape"),
  (lambda x: _diag(dict(x, q=x["q"].astype(jnp.int32))), TypeError, "q must be a floating array"),
  (lambda x: _diag(x, info_scale=0.0), ValueError, "info_scale (mu) must be > 0"),
  (lambda x: _diag(x, info_scale=-1.0), ValueError, "info_scale (mu) must be > 0"),
  (
    lambda x: _diag(x, info_scale=np.ones(H + 1)),
    ValueError,
    "info_scale must be a float or an array of shape [H]",
  ),
  (
    lambda x: _diag(x, impl="cuda"),
    ValueError,
    "impl='cuda' is not one of auto, reference, chunked, pallas",
  ),
  (lambda x: _diag(x, chunk_size=40), ValueError, "chunk_size"),
  (
    lambda x: _diag(x, segment_ids=jnp.zeros((B, T + 1), jnp.int32)),
    ValueError,
    "segment_ids must have shape [B, T]",
  ),
  (lambda x: _diag(x, segment_ids=jnp.zeros((B, T))), TypeError, "segment_ids must be integers"),
  (
    lambda x: _diag(x, initial_state=ops.KDNState(jnp.zeros((B, H, K, V)), jnp.ones((B, H)))),
    ValueError,
    "initial_state.variance must have shape",
  ),
  (
    lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["log_alpha"][..., :3], x["k"]),
    ValueError,
    "log_alpha must have shape",
  ),
  (
    lambda x: ops.delta_rule(x["q"], x["k"], x["v"], x["log_alpha"], x["k"][..., :1]),
    ValueError,
    "write must have shape [B, T, H, K] = (2, 40, 4, 16) (a direction) or "
    "[B, T, H] = (2, 40, 4) (a scalar beta: write = beta k), got (2, 40, 4, 1)",
  ),
  (
    lambda x: ops.iso_kdn(x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], x["r"]),
    ValueError,
    "omega must have shape [B, T, H]",
  ),
  # An explicit impl='pallas' never falls back to chunked: it names the value.
  (
    lambda x: ops.delta_rule(*(jnp.zeros((1, 4, 1, 300)),) * 5, impl="pallas"),
    ValueError,
    "delta_rule: impl='pallas': K (key width) = 300 is not supported by the Pallas kernels "
    "(at most 256)",
  ),
  # Grouped value heads: v's heads a multiple of q's and k's.
  (
    lambda x: ops.kda(x["q"][:, :, :3], x["k"][:, :, :3], x["v"], x["log_alpha"], x["r"]),
    ValueError,
    "kda: v has 4 heads and q, k have 3: grouped value heads need the value heads "
    "to be a multiple of the query/key heads",
  ),
  (
    lambda x: _diag(dict(x, v=x["v"][:, :, :2])),
    ValueError,
    "diag_kdn: v has 2 heads and q, k have 4",
  ),
  (
    lambda x: ops.iso_kdn_step(
      *(x[n][:, 0, :3] for n in ("q", "k")),
      *(x[n][:, 0] for n in ("v", "log_alpha", "r", "r")),
      ops.KDNState(jnp.zeros((B, H, K, V)), jnp.ones((B, H))),
    ),
    ValueError,
    "iso_kdn_step: v has 4 heads and q, k have 3",
  ),
  (
    lambda x: ops.delta_rule(
      x["q"], x["k"], x["q"], x["log_alpha"], x["k"], impl="pallas", chunk_size=8
    ),
    ValueError,
    "chunk_size = 8 is not supported by the Pallas kernels (supported: 16, 32, 64, 128 or None)",
  ),
]


@pytest.mark.parametrize("i", range(len(BAD_INPUTS)))
def test_bad_inputs_raise_while_tracing(i):
  fn, exc, msg = BAD_INPUTS[i]
  x = _inputs()
  with pytest.raises(exc, match=re.escape(msg)):
    fn(x)
  # Also under jit: the error comes at trace time, before any compile.
  with pytest.raises(exc, match=re.escape(msg)):
    jax.jit(lambda: fn(x)).lower()


def test_pallas_delta_rule_scale_forms_agree():
  """impl='pallas' with bf16 data (q, k, v reach the kernels uncast, scale applied inside): a
  Python scale, a traced scale and the chunked path agree within bf16 rounding."""
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  b, t, h, d = 1, 20, 2, 16
  q, k, w = (jax.random.normal(x, (b, t, h, d)).astype(jnp.bfloat16) * 0.3 for x in ks[:3])
  v = jax.random.normal(ks[3], (b, t, h, d)).astype(jnp.bfloat16)
  la = -jax.nn.softplus(jax.random.normal(ks[4], (b, t, h))).astype(jnp.bfloat16)
  run = lambda s, impl: ops.delta_rule(q, k, v, la, w, scale=s, impl=impl)[0]
  o_py = run(0.37, "pallas")
  o_traced = jax.jit(lambda s: run(s, "pallas"))(jnp.float32(0.37))
  o_chunked = run(0.37, "chunked")
  # The kernels' own entry point takes a traced scale too.
  s0 = jnp.zeros((b, h, d, d))
  o_kernel = jax.jit(lambda s: pallas_kernels.delta_rule(q, k, v, la, w, s, s0)[0])(
    jnp.float32(0.37)
  )
  assert o_traced.dtype == o_kernel.dtype == jnp.bfloat16
  for o in (o_traced, o_chunked, o_kernel):
    assert rel_err(o, o_py) <= 5e-3, rel_err(o, o_py)


def test_auto_falls_back_with_the_reason_logged_once(monkeypatch, caplog):
  """'auto' on a Pallas platform runs chunked for widths the kernels lack and
  says why, once per (op, reason); supported widths get the kernels."""
  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(dispatch, "PALLAS_AUTO_PLATFORMS", (jax.default_backend(),))
  monkeypatch.setattr(dispatch, "_FALLBACKS_LOGGED", set())
  caplog.set_level(logging.WARNING)
  # (any K up to the widest kernel width and any V: ops/widths.py pads and tiles them)
  for kd, vd in ((16, 16), (8, 8), (48, 96), (128, 512), (256, 256), (200, 16)):
    assert dispatch.resolve_impl("diag_kdn", "auto", kd, vd, None) == "pallas"
  for _ in range(2):
    assert dispatch.resolve_impl("diag_kdn", "auto", 384, 16, None) == "chunked"
  assert dispatch.resolve_impl("diag_kdn", "auto", 16, 16, 8) == "chunked"
  msgs = [r.getMessage() for r in caplog.records if "impl='auto'" in r.getMessage()]
  assert msgs == [
    "diag_kdn: impl='auto' uses 'chunked': K (key width) = 384 is not "
    "supported by the Pallas kernels (at most 256)",
    "diag_kdn: impl='auto' uses 'chunked': chunk_size = 8 is not supported "
    "by the Pallas kernels (supported: 16, 32, 64, 128 or None)",
  ], msgs
  # Through an op: chunk_size = 8 under 'auto' gives the chunked result.
  x = _inputs()
  np.testing.assert_array_equal(
    _diag(x, impl="auto", chunk_size=8)[0], _diag(x, impl="chunked", chunk_size=8)[0]
  )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's 'auto' rule")
def test_auto_on_cpu_is_the_token_loop_while_its_states_are_small(monkeypatch):
  """CPU: 'auto' runs 'reference' up to CPU_REFERENCE_MAX_STATE_BYTES of per-token states
  (B*T*H*K*V fp32), 'chunked' past it; explicit impls and calls without a size are unchanged."""
  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  limit = dispatch.CPU_REFERENCE_MAX_STATE_BYTES
  assert dispatch.resolve_impl("diag_kdn", "auto", 32, 32, None, limit) == "reference"
  assert dispatch.resolve_impl("diag_kdn", "auto", 32, 32, None, limit + 1) == "chunked"
  assert dispatch.resolve_impl("diag_kdn", "auto") == "chunked"
  assert dispatch.resolve_impl("diag_kdn", "chunked", 32, 32, None, 1) == "chunked"
  x = _inputs()
  ref, chunked = _diag(x, impl="reference")[0], _diag(x, impl="chunked")[0]
  assert not np.array_equal(
    ref, chunked
  )  # (the two differ in rounding: the test can tell them apart)
  np.testing.assert_array_equal(_diag(x, impl="auto")[0], ref)
  monkeypatch.setattr(dispatch, "CPU_REFERENCE_MAX_STATE_BYTES", 4 * B * T * H * K * V - 1)
  np.testing.assert_array_equal(_diag(x, impl="auto")[0], chunked)
  g = (x["log_alpha"][..., 0], jax.nn.sigmoid(x["r"]))  # gated delta rule: g [B,T,H], beta [B,T,H]
  np.testing.assert_array_equal(
    ops.gated_delta_rule(x["q"], x["k"], x["v"], *g, impl="auto")[0],
    ops.gated_delta_rule(x["q"], x["k"], x["v"], *g, impl="chunked")[0],
  )


def test_pallas_limits_match_the_kernels():
  """dispatch reads the kernels' limits; the kernels' own checks agree."""
  x = jnp.zeros((1, 4, 1, 16))
  s0 = jnp.zeros((1, 1, 16, 16))
  for c in pallas_kernels.common.SUPPORTED_CHUNKS[::3]:  # 16 and 128
    pallas_kernels.delta_rule(x, x, x, x, x, 1.0, s0, chunk_size=c)
  for c in (8, 48, 256):
    with pytest.raises(NotImplementedError):
      pallas_kernels.delta_rule(x, x, x, x, x, 1.0, s0, chunk_size=c)


# checked=True: (call, message). x has K = 16, V = 8, H = 4; the checks come
# before any impl, so the cheapest to compile (reference) runs them.
R = dict(checked=True, impl="reference")
BAD_VALUES = [
  (
    lambda x: _diag(dict(x, r=x["r"].at[0, 2, 1].set(-0.5)), **R),
    "diag_kdn: r must be > 0; got 1 bad value(s), first -0.5",
  ),
  (
    lambda x: _diag(dict(x, r=x["r"].at[1, 0, 0].set(jnp.nan)), **R),
    "diag_kdn: r must be > 0; got 1 bad value(s), first nan",
  ),
  (
    lambda x: _diag(dict(x, log_alpha=x["log_alpha"].at[0, 2].set(0.25)), **R),
    f"diag_kdn: log_alpha must be <= 0; got {H * K} bad value(s), first 0.25",
  ),
  (
    lambda x: ops.iso_kdn(x["q"], x["k"], x["v"], x["log_alpha"], -x["r"], x["r"], **R),
    "iso_kdn: omega must be >= 0",
  ),
  (
    lambda x: _diag(
      x, initial_state=ops.KDNState(jnp.zeros((B, H, K, V)), jnp.zeros((B, H, K))), **R
    ),
    "diag_kdn: initial_state.variance must be > 0",
  ),
  (
    lambda x: ops.kda(x["q"], x["k"], x["v"], -x["log_alpha"], x["r"], **R),
    "kda: g (log decay) must be <= 0",
  ),
  (
    lambda x: ops.delta_rule(x["q"], x["k"], x["v"], -x["log_alpha"], x["k"], **R),
    "delta_rule: log_alpha must be <= 0",
  ),
  (
    lambda x: ops.gla_step(
      x["q"][:, 0],
      x["k"][:, 0],
      x["v"][:, 0],
      -x["log_alpha"][:, 0],
      jnp.zeros((B, H, K, V)),
      checked=True,
    ),
    "gla_step: g (log decay) must be <= 0",
  ),
  (
    lambda x: ops.diag_kdn_step(
      *(x[n][:, 0] for n in ("q", "k", "v", "log_alpha", "omega")),
      -x["r"][:, 0],
      ops.KDNState(jnp.zeros((B, H, K, V)), jnp.ones((B, H, K))),
      checked=True,
    ),
    "diag_kdn_step: r must be > 0",
  ),
]


@pytest.mark.parametrize("i", range(len(BAD_VALUES)))
def test_checked_mode_names_the_bad_value(i):
  """Eagerly, and jitted through ops.checked: the same named error."""
  fn, msg = BAD_VALUES[i]
  x = _inputs(t=3)
  with pytest.raises(ops.InvalidValueError, match=re.escape(msg)):
    fn(x)
  with pytest.raises(ops.InvalidValueError, match=re.escape(msg)):
    ops.checked(jax.jit(fn))(x)


def test_checked_mode_traced_info_scale_and_gradients():
  """A learned (traced) mu is checked too; with good values the checks change
  nothing, gradients included, and they pass through the Pallas path."""
  x = _inputs(t=8)
  x["v"] = x["q"]  # V = 16, a width the Pallas kernels take

  def loss(x, mu, impl, checked):
    return jnp.sum(_diag(x, info_scale=mu, impl=impl, checked=checked)[0] ** 2)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
  mu = jnp.full((H,), float(K))
  with pytest.raises(
    ops.InvalidValueError,
    match=re.escape("diag_kdn: info_scale must be > 0; got 1 bad value(s), first -1.0"),
  ):
    ops.checked(grad)(x, mu.at[2].set(-1.0), "reference", True)
  got = ops.checked(grad)(x, mu, "pallas", True)
  want = grad(x, mu, "reference", False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) <= 1e-5, rel_err(a, b)
