"""experiments/probe_pair_rows.py's variants (timed on the GPU only) compute what the shipped
pair kernel does, interpret mode: the chunk-16 diagonal tile by rows or by columns, and the
chunk-64 structure before session 32 (small dots under pl.when) against the shipped one-dot
kernel."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import probe_pair_rows as probe
from pallas_kernels.delta_rule import config as dcfg
from pallas_kernels.delta_rule import intra


def _inputs(t, chunk, kd=16):
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, w = (jax.random.normal(kk, (1, t, 1, kd), jnp.float32).astype(jnp.bfloat16)
             for kk in ks[:3])
  la = -jax.nn.softplus(jax.random.normal(ks[3], (1, t, 1, kd)))
  g = jnp.cumsum(la.reshape(1, t // chunk, chunk, 1, kd), axis=2).reshape(1, t, 1, kd)
  return q, k, w, g


def _close(got, want):
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=1e-2, atol=1e-3)


def test_diagonal_tile_by_rows_matches_columns():
  q, k, w, g = _inputs(48, 16)
  run = lambda kern: probe.call(functools.partial(kern, scale=0.25), q, k, w, g, (1, 1, 3), 4,
                                16)
  rows, cols = run(probe.kern_diag_rows), run(probe.kern_diag_cols)
  assert float(jnp.max(jnp.abs(cols[0]))) > 0.1   # a nonzero strict lower triangle
  _close(rows, cols)


def test_small_dot_variant_matches_the_shipped_pair_kernel():
  q, k, w, g = _inputs(128, 64)
  scale = 16 ** -0.5
  lmat, pmat, _ = probe.call(functools.partial(probe.kern_cols, off=True, scale=scale), q, k, w,
                             g, (1, 1, 2, 4), 4)
  cfg = dcfg.DeltaRuleConfig(max_chunk=64, min_chunk=64, sub_block=16)
  want_l, want_p = intra.pair_rows_forward(q, k, w, g, None, chunk=64, scale=scale,
                                          interpret=True, cfg=cfg, cfg_prec="fast")[:2]
  np.testing.assert_allclose(np.asarray(lmat), np.asarray(want_l), rtol=1e-5, atol=1e-6)
  _close((pmat,), (want_p,))
