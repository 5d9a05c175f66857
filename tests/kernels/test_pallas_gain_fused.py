"""pallas_kernels.diag_gain_fused / iso_gain_fused (the gate front-end inside the gain kernels)
against the plain-JAX front-end feeding the unfused gain kernels (CPU interpret mode): values,
the emitted log_alpha, and the gradients of every input, with a cotangent on log_alpha too (the
delta rule's share)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kdn_gain

R_MIN = 0.01


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-300)))


def _composed(diag, k, f, dtb, alog, om_raw, r_raw, mu, p0, seg, chunk):
  """The layer's plain-JAX front-end (layers.decay.Decay, KDNMixer.noise_params), then the gain."""
  la = -jnp.exp(alog.astype(jnp.float32))[:, None] * jax.nn.softplus(
    f.astype(jnp.float32) + dtb.astype(jnp.float32)
  )
  om = jax.nn.softplus(om_raw.astype(jnp.float32))
  r = R_MIN + jax.nn.softplus(r_raw.astype(jnp.float32))
  fn = kdn_gain.diag_gain if diag else kdn_gain.iso_gain
  gain, pf = fn(k.astype(jnp.float32), la, om, r, mu, p0, seg, chunk_size=chunk)
  return gain, la, pf


def _fused(diag, k, f, dtb, alog, om_raw, r_raw, mu, p0, seg, chunk):
  fn = kdn_gain.diag_gain_fused if diag else kdn_gain.iso_gain_fused
  return fn(k, f, dtb, alog, om_raw, r_raw, R_MIN, mu, p0, seg, chunk_size=chunk)


def _inputs(seed, b, t, h, kd, diag, dtype):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, t, h, kd)) / np.sqrt(kd)
  f = rng.normal(size=(b, t, h, kd))
  dtb = np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(h, kd)))))
  alog = np.log(rng.uniform(1, 16, size=(h,)))
  om_raw = rng.normal(size=(b, t, h, kd) if diag else (b, t, h)) - 2.0
  r_raw = rng.normal(size=(b, t, h))
  mu = np.full((h,), float(kd))
  p0 = 0.1 + np.abs(rng.normal(size=(b, h, kd) if diag else (b, h)))
  cast = lambda x, d: jnp.asarray(x, jnp.float32).astype(d)
  # projections in the compute dtype, parameters and state in fp32 (as in the layer)
  return [
    cast(k, dtype),
    cast(f, dtype),
    cast(dtb, jnp.float32),
    cast(alog, jnp.float32),
    cast(om_raw, dtype),
    cast(r_raw, dtype),
    cast(mu, jnp.float32),
    cast(p0, jnp.float32),
  ]


@pytest.mark.parametrize(
  "diag,t,segs,dtype",
  [
    (True, 37, (5, 21), jnp.float32),  # T not a multiple of the chunk, segments
    (False, 20, (7,), jnp.bfloat16),  # bf16 projections (the layer's compute dtype)
    (True, 1, None, jnp.bfloat16),  # T = 1
    (False, 40, None, jnp.float32),  # several chunks without segments (no reset flags)
  ],
)
def test_fused_front_matches_composition(diag, t, segs, dtype):
  b, h, kd, chunk = 2, 2, 16, 16
  args = _inputs(t, b, t, h, kd, diag, dtype)
  seg = None
  if segs is not None:
    seg = np.zeros((b, t), np.int32)
    for s in segs:
      seg[:, s:] += 1
    seg = jnp.asarray(seg)
  rng = np.random.default_rng(1)
  out_shapes = jax.eval_shape(lambda *a: _composed(diag, *a, seg, chunk), *args)
  cts = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in out_shapes]

  def outputs_and_grads(fn):
    # one compile per side: the outputs and the VJP of the cotangents (also on log_alpha)
    def run(*a):
      outs, vjp = jax.vjp(lambda *a: fn(diag, *a, seg, chunk), *a)
      return outs, vjp(tuple(cts))

    return jax.jit(run)(*args)

  want, g_want = outputs_and_grads(_composed)
  got, g_got = outputs_and_grads(_fused)
  tol = 1e-6 if dtype == jnp.float32 else 1e-5
  for name, x, y in zip(("gain", "log_alpha", "p_final"), got, want):
    assert x.dtype == jnp.float32 and x.shape == y.shape, name
    assert _rel(x, y) <= tol, (name, _rel(x, y))
  names = ("k", "f", "dt_bias", "a_log", "omega_raw", "r_raw", "info_scale", "p0")
  # bf16: the composition rounds each projection gradient once from fp32, the fused kernel
  # too; k's gradient is rounded from fp32 in both; the tolerance covers summation order
  gtol = 1e-5 if dtype == jnp.float32 else 1e-3
  errs = {n: _rel(x, y) for n, x, y in zip(names, g_got, g_want)}
  for n, x, y in zip(names, g_got, g_want):
    assert x.dtype == y.dtype and x.shape == y.shape, n
    assert errs[n] <= gtol, (n, errs)


def test_fused_front_shape_errors_name_the_argument():
  args = _inputs(3, 1, 8, 2, 16, True, jnp.float32)
  with pytest.raises(ValueError, match="dt_bias"):
    kdn_gain.diag_gain_fused(args[0], args[1], args[2][0], *args[3:6], R_MIN, args[6], args[7])
  with pytest.raises(ValueError, match="r_min"):
    kdn_gain.diag_gain_fused(*args[:6], 0.0, args[6], args[7])
