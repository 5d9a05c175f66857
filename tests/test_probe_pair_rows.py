"""experiments/probe_pair_rows.py's one-dot variant (a candidate for the chunk-64 pair kernel,
timed on the GPU only) computes what the shipped pair kernel does: L and P of a 64-token chunk,
interpret mode."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import probe_pair_rows as probe
from pallas_kernels.delta_rule import config as dcfg
from pallas_kernels.delta_rule import intra


def test_one_dot_variant_matches_the_shipped_pair_kernel():
  b, t, h, kd = 1, 128, 1, 16
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, w = (jax.random.normal(kk, (b, t, h, kd), jnp.float32).astype(jnp.bfloat16)
             for kk in ks[:3])
  la = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, kd)))
  g = jnp.cumsum(la.reshape(b, t // 64, 64, h, kd), axis=2).reshape(b, t, h, kd)
  scale = kd ** -0.5
  lmat, pmat, _ = probe.call(functools.partial(probe.kern_one_dot, scale=scale), q, k, w, g,
                             (b, h, t // 64, 4), 4)
  cfg = dcfg.DeltaRuleConfig(max_chunk=64, min_chunk=64, sub_block=16)
  want_l, want_p, _ = intra.pair_rows_forward(q, k, w, g, None, chunk=64, scale=scale,
                                              interpret=True, cfg=cfg, cfg_prec="fast")
  assert float(jnp.max(jnp.abs(want_l))) > 0.1   # a nonzero strict lower triangle
  np.testing.assert_allclose(np.asarray(lmat), np.asarray(want_l), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(pmat, np.float32), np.asarray(want_p, np.float32),
                             rtol=1e-2, atol=1e-3)
