"""Accuracy of pallas_kernels.diag_gain / iso_gain (CPU interpret mode) vs a float64 token loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import diag_gain, iso_gain


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-300)))


def _reset(seg, b, t):
  if seg is None:
    return jnp.zeros((b, t), bool)
  return jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def _diag_oracle(k, la, om, r, mu, p0, seg):
  kd = k.shape[-1]

  def step(p, xs):
    kt, lat, omt, rt, rs = xs
    p = jnp.where(rs[:, None, None], p0, p)
    ph = jnp.exp(2 * lat) * p + omt
    kap = ph * kt / (rt[..., None] + jnp.sum(ph * kt * kt, -1, keepdims=True))
    u = mu[None, :, None] * kt * kt / rt[..., None]
    return ph / (1 + u * ph), kap

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (k, la, om, r, _reset(seg, *k.shape[:2])))
  p, kap = jax.lax.scan(step, p0, xs)
  del kd
  return jnp.moveaxis(kap, 0, 1), p


def _iso_oracle(k, la, om, r, mu, b0, seg):
  kd = k.shape[-1]

  def step(bv, xs):
    kt, lat, omt, rt, rs = xs
    bv = jnp.where(rs[:, None], b0, bv)
    bh = jnp.mean(jnp.exp(2 * lat), -1) * bv + omt
    s = jnp.sum(kt * kt, -1)
    beta = bh / (rt + bh * s)
    return bh / (1 + mu[None, :] * bh * s / (kd * rt)), beta

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (k, la, om, r, _reset(seg, *k.shape[:2])))
  bv, beta = jax.lax.scan(step, b0, xs)
  return jnp.moveaxis(beta, 0, 1), bv


def _inputs(seed, b, t, h, kd, diag, dtype, r_val, strong):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, t, h, kd)) / np.sqrt(kd)
  la = -np.abs(rng.normal(size=(b, t, h, kd))) * 0.2
  if strong:
    la[:, ::3] = -20.0
  om = 0.1 * np.abs(rng.normal(size=(b, t, h, kd) if diag else (b, t, h)))
  r = np.full((b, t, h), r_val) if r_val is not None else 0.01 + np.abs(rng.normal(size=(b, t, h)))
  p0 = 0.1 + np.abs(rng.normal(size=(b, h, kd) if diag else (b, h)))
  arrs = [jnp.asarray(x, jnp.float32).astype(dtype) for x in (k, la, om, r)]
  return arrs + [jnp.asarray(p0, jnp.float32)]


# The ops tests (ops_cases) hold diag_kdn / iso_kdn(impl="pallas") to the float64 loop with the
# gain at its default chunk (T = 1, one partial chunk, mu and every other gradient); these cases
# keep what only a caller's chunk_size reaches: several gain chunks, T = chunk + 1.
CASES = [
  # (t, chunk, mu factor (x K), r value or None, strong decay, segment starts)
  (33, 32, 4.0, 1e-3, True, (5, 6, 31)),  # T = chunk + 1, r = 1e-3, mu = 4K, segments
  (70, 16, 1.0, None, True, (40,)),
  (70, 16, 1.0, None, True, None),  # no segments: no reset flags read (UNSEGMENTED)
]


@pytest.mark.parametrize("diag", [True, False])
@pytest.mark.parametrize("t,chunk,mu_f,r_val,strong,segs", CASES)
def test_gain_fp32(diag, t, chunk, mu_f, r_val, strong, segs):
  _run(diag, t, chunk, mu_f, r_val, strong, segs, jnp.float32, 1e-5, 1e-4)


@pytest.mark.parametrize("diag", [True, False])
def test_gain_bf16(diag):
  _run(diag, 40, 16, 1.0, None, False, (17,), jnp.bfloat16, 5e-3, 1e-2)


def _run(diag, t, chunk, mu_f, r_val, strong, segs, dtype, tol_fwd, tol_grad, config=None):
  b, h, kd = 2, 2, 64
  args = _inputs(t, b, t, h, kd, diag, dtype, r_val, strong)
  mu = jnp.full((h,), mu_f * kd, jnp.float32)
  seg = None
  if segs is not None:
    seg = np.zeros((b, t), np.int32)
    for s in segs:
      seg[:, s:] += 1
  segj = None if seg is None else jnp.asarray(seg)
  fn = diag_gain if diag else iso_gain
  oracle = _diag_oracle if diag else _iso_oracle
  # args: k, log_alpha, omega, r, p0, info_scale (all differentiated).
  args = args + [mu]
  f = jax.jit(lambda *a: fn(*a[:4], a[5], a[4], segj, chunk_size=chunk, config=config))
  gain, pf = f(*args)
  assert gain.dtype == jnp.float32 and pf.dtype == jnp.float32
  rng = np.random.default_rng(9)
  ct_g = rng.normal(size=gain.shape)
  ct_p = rng.normal(size=pf.shape)
  argnums = tuple(range(6))
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in args]
    seg64 = None if seg is None else jnp.asarray(seg)
    rgain, rp = oracle(*a64[:4], a64[5], a64[4], seg64)

    def loss64(*a):
      g64, p64 = oracle(*a[:4], a[5], a[4], seg64)
      return jnp.sum(g64 * ct_g) + jnp.sum(p64 * ct_p)

    rg = [np.asarray(x) for x in jax.jit(jax.grad(loss64, argnums=argnums))(*a64)]
    rgain, rp = np.asarray(rgain), np.asarray(rp)
  assert _rel(gain, rgain) <= tol_fwd, _rel(gain, rgain)
  assert _rel(pf, rp) <= tol_fwd, _rel(pf, rp)

  def loss(*a):
    gain, pf = f(*a)
    return jnp.sum(gain * ct_g) + jnp.sum(pf * ct_p)

  g = jax.jit(jax.grad(loss, argnums=argnums))(*args)
  names = ("k", "log_alpha", "omega", "r", "p0", "info_scale")
  errs = {n: _rel(x, y) for n, x, y in zip(names, g, rg)}
  for n, e in errs.items():
    assert e <= tol_grad, (n, errs)


def test_gain_tpu_interpret_matches():
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  args = _inputs(4, 1, 20, 1, 64, True, jnp.float32, None, False)
  mu = jnp.full((1,), 64.0)
  a = diag_gain(*args[:4], mu, args[4], chunk_size=16, interpret=pltpu.InterpretParams())
  b = diag_gain(*args[:4], mu, args[4], chunk_size=16, interpret=True)
  assert _rel(a[0], b[0]) < 1e-6 and _rel(a[1], b[1]) < 1e-6


def test_gain_shape_errors_name_the_argument():
  args = _inputs(5, 1, 8, 2, 16, True, jnp.float32, None, False)
  mu = jnp.full((2,), 16.0)
  with pytest.raises(ValueError, match="omega"):
    diag_gain(args[0], args[1], args[2][..., 0], args[3], mu, args[4])
  with pytest.raises(ValueError, match="b0"):
    iso_gain(args[0], args[1], args[2][..., 0], args[3], mu, args[4])


def test_gain_dtype_bf16_is_the_fp32_gain_rounded():
  """diag_gain(gain_dtype=bfloat16) (pallas_kernels.write_dtype's for bf16 data): kappa in bf16, the
  fp32 kernel's kappa rounded; gradients through it as through the fp32 gain given the same
  (bf16) cotangent; another dtype is refused, naming the argument."""
  k, la, om, r, p0 = _inputs(6, 1, 40, 2, 16, True, jnp.float32, None, False)
  mu = jnp.full((2,), 16.0)
  seg = jnp.asarray((np.arange(40) >= 17)[None].astype(np.int32))
  f32, pf32 = diag_gain(k, la, om, r, mu, p0, seg)
  b16, pb16 = diag_gain(k, la, om, r, mu, p0, seg, gain_dtype=jnp.bfloat16)
  assert b16.dtype == jnp.bfloat16 and pb16.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(b16, np.float32), np.asarray(f32.astype(jnp.bfloat16), np.float32)
  )
  np.testing.assert_array_equal(pb16, pf32)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=k.shape), jnp.bfloat16)

  def grads(dtype):
    loss = lambda *a: jnp.sum(
      diag_gain(*a, mu, p0, seg, gain_dtype=dtype)[0].astype(jnp.float32) * ct.astype(jnp.float32)
    )
    return jax.grad(loss, argnums=(0, 1, 2, 3))(k, la, om, r)

  for a, b in zip(grads(jnp.bfloat16), grads(jnp.float32)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="gain_dtype must be float32 or bfloat16"):
    diag_gain(k, la, om, r, mu, p0, gain_dtype=jnp.float16)


def test_gain_chunk_caps():
  """The gain's chunk: the caller's chunk_size capped by GainConfig.max_chunk and by T's next
  power of two (16 at least)."""
  from pallas_kernels import kdn_gain
  from pallas_kernels.kdn_gain import config as gain_config

  cfg = gain_config.GainConfig(max_chunk=128)
  assert kdn_gain.gain_chunk(16384, 256, cfg) == 128
  assert kdn_gain.gain_chunk(70, 256, cfg) == 128
  assert kdn_gain.gain_chunk(70, 64, cfg) == 64
  assert kdn_gain.gain_chunk(40, 256, cfg) == 64
  assert kdn_gain.gain_chunk(1, 256, cfg) == 16


def test_pow2_inverse_keeps_the_products_in_range():
  """The reduce's renormalisation factor: an exact power of two that puts a normal s in [1, 2),
  never 0 (s near the fp32 maximum: 2^-126) and finite for a subnormal s."""
  from pallas_kernels.kdn_gain.kernel import _pow2_inverse

  tiny = np.float32(np.finfo(np.float32).tiny) / 8  # subnormal
  s = jnp.asarray([1.0, 3.0, 0.3, 2.0**126, 1.5 * 2.0**127, tiny, np.inf], jnp.float32)
  inv = np.asarray(_pow2_inverse(s))
  assert np.all(inv > 0) and np.all(np.isfinite(inv))
  assert np.all(np.log2(inv) == np.round(np.log2(inv)))  # powers of two
  scaled = np.asarray(s, np.float64) * inv
  np.testing.assert_array_equal(scaled[:4], [1.0, 1.5, np.float32(0.3) * 4.0, 1.0])
  assert 1.0 <= scaled[4] < 4.0 and scaled[5] < 2.0 and np.isinf(scaled[6])


def test_unsegmented_kernels_match_the_segmented_ones():
  """Without segments the kernels skip the reset flags (kernel.py, UNSEGMENTED); with the flags
  read (only token 0 set) they give the same gain, final variance and gradients, to fp32
  rounding."""
  from pallas_kernels.kdn_gain import config as gain_config
  from pallas_kernels.kdn_gain import kernel as gk

  b, t, h, kd, chunk = 2, 64, 2, 32, 16
  k, la, om, r, p0 = _inputs(3, b, t, h, kd, True, jnp.float32, None, True)
  mu = jnp.full((h,), 1.0 * kd, jnp.float32)
  reset = jnp.zeros((b, t), jnp.int32).at[:, 0].set(1)
  kw = dict(diag=True, chunk=chunk, interpret=True, cfg=gain_config.GainConfig())
  outs = {}
  for seg in (True, False):
    gain, pprev, pfin, _ = gk.gain_forward((k, la, om, r, mu), reset, p0, segmented=seg, **kw)
    dgain = jnp.cos(jnp.arange(gain.size, dtype=jnp.float32)).reshape(gain.shape)
    grads = gk.gain_backward(
      (k, la, om, r, mu), reset, pprev, dgain, jnp.ones_like(pfin), segmented=seg, **kw
    )
    outs[seg] = [gain, pprev, pfin] + list(grads[0]) + [grads[1]]
  for a, c in zip(outs[True], outs[False]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-6, atol=1e-7)


def test_iso_replay_against_the_float64_loop():
  """iso_gain (its replay over per-token scalars in the trace): the float64 token loop's gain,
  final variance and gradients (the backward is the lane kernels', from the replay's p_prev),
  T = chunk + 1 with segments, and several chunks without."""
  k, la, om, r, b0 = _inputs(1, 1, 20, 2, 16, False, jnp.float32, None, False)
  jaxpr = str(jax.make_jaxpr(lambda *a: iso_gain(*a))(k, la, om, r, jnp.ones((2,)), b0))
  assert "kdn_gain_iso_replay" in jaxpr and "kdn_gain_replay" not in jaxpr
  _run(False, 33, 32, 4.0, 1e-3, True, (5, 6, 31), jnp.float32, 1e-5, 1e-4)
  _run(False, 70, 16, 1.0, None, True, None, jnp.float32, 1e-5, 1e-4)
