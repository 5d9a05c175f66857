"""The Moebius scan primitive and the KDN variance scans built on it."""

import jax
import jax.numpy as jnp
import kdn_oracle
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kdn_jax import ops


def _positive(t):
  return hnp.arrays(np.float64, (t,), elements=st.floats(0.05, 3.0))


# Lengths from a fixed set (T = 1, odd, powers of two and around them): each new length compiles
# the scan again, which was most of this test's 43 s with any length in 1..40.
@settings(max_examples=40, deadline=None)
@given(
  st.sampled_from([1, 2, 3, 7, 16, 33, 40]).flatmap(
    lambda t: st.tuples(_positive(t), _positive(t), _positive(t), _positive(t))
  ),
  st.floats(0.0, 5.0),
  st.booleans(),
)
def test_scan_equals_sequential_map(abcd, x0, reverse):
  a, b, c, d = abcd
  with jax.enable_x64(True):
    got = np.asarray(
      ops.mobius_scan(
        *(jnp.asarray(v[None]) for v in abcd), jnp.asarray([x0]), axis=1, reverse=reverse
      )
    )[0]
  if reverse:
    want = kdn_oracle.mobius_sequential(a[::-1], b[::-1], c[::-1], d[::-1], x0)[::-1]
  else:
    want = kdn_oracle.mobius_sequential(a, b, c, d, x0)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_broadcast_x0_and_other_axis():
  rng = np.random.default_rng(0)
  a, b, c, d = (jnp.asarray(0.1 + rng.random((3, 2, 9))) for _ in range(4))
  x0 = jnp.asarray(rng.random((2,)))
  got = ops.mobius_scan(a, b, c, d, x0, axis=2)
  for i in range(3):
    for j in range(2):
      want = kdn_oracle.mobius_sequential(
        *(np.asarray(m[i, j], np.float64) for m in (a, b, c, d)), float(x0[j])
      )
      np.testing.assert_allclose(got[i, j], want, rtol=2e-6)


def test_million_steps_stay_finite_in_float32():
  t = 1_000_000
  ones = jnp.ones((1, t), jnp.float32)
  scan = jax.jit(lambda a, b, c, d: ops.mobius_scan(a, b, c, d, 1.0))
  # Contracting products (KDN with decay 0.9): entries shrink like 0.81^t.
  u = 2.0
  x = scan(0.81 * ones, 0.01 * ones, u * 0.81 * ones, (1 + u * 0.01) * ones)
  assert np.all(np.isfinite(x))
  # Fixed point of p = (0.81 p + w) / (u 0.81 p + 1 + u w).
  aa, bb, cc, dd = 0.81, 0.01, u * 0.81, 1 + u * 0.01
  fp = ((aa - dd) + np.sqrt((aa - dd) ** 2 + 4 * bb * cc)) / (2 * cc)
  np.testing.assert_allclose(x[0, -1], fp, rtol=1e-5)
  # Expanding products (entries grow like 3^t) with a finite limit.
  x = scan(3.0 * ones, ones, ones, ones)
  assert np.all(np.isfinite(x))
  np.testing.assert_allclose(x[0, -1], 1 + np.sqrt(2), rtol=1e-5)


def test_variance_scans_match_token_loop():
  rng = np.random.default_rng(1)
  b, t, h, k = 2, 50, 3, 8
  kk = rng.standard_normal((b, t, h, k)) / np.sqrt(k)
  la = -np.abs(rng.standard_normal((b, t, h, k)))
  om = 0.1 * rng.random((b, t, h, k))
  r = 0.01 + rng.random((b, t, h))
  mu = np.array([1.0, 8.0, 32.0])
  p0 = 0.5 + rng.random((b, h, k))
  with jax.enable_x64(True):
    p_hat, p = ops.diag_variance_scan(*map(jnp.asarray, (kk, la, om, r, mu, p0)))
  pp, want_hat, want = p0, [], []
  for i in range(t):
    ph = np.exp(2 * la[:, i]) * pp + om[:, i]
    pp = ph / (1 + mu[:, None] * kk[:, i] ** 2 / r[:, i, :, None] * ph)
    want_hat.append(ph)
    want.append(pp)
  np.testing.assert_allclose(p_hat, np.stack(want_hat, 1), rtol=1e-12)
  np.testing.assert_allclose(p, np.stack(want, 1), rtol=1e-12)
  # Isotropic: scalar per head.
  om_i, b0 = om[..., 0], p0[..., 0]
  with jax.enable_x64(True):
    b_hat, bb = ops.iso_variance_scan(*map(jnp.asarray, (kk, la, om_i, r, mu, b0)))
  bp, want = b0, []
  for i in range(t):
    bh = np.mean(np.exp(2 * la[:, i]), -1) * bp + om_i[:, i]
    bp = bh / (1 + mu * bh * np.sum(kk[:, i] ** 2, -1) / (k * r[:, i]))
    want.append(bp)
  np.testing.assert_allclose(bb, np.stack(want, 1), rtol=1e-12)
  assert b_hat.shape == (b, t, h)
