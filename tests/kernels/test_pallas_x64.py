"""The Pallas kernels with x64 on (jax.enable_x64: Python ints trace as int64, unpinned arrays as
64-bit), CPU interpret mode: every kernel runs, the delta rule's and the gains' forward and
backward stay within the fp32 bounds of the float64 loop, and every kernel gives the values it
gives without x64."""

import jax
import jax.numpy as jnp
import numpy as np
import test_pallas_delta_rule as tdr
import test_pallas_gain as tg

from pallas_kernels import kdn_gain
from pallas_kernels.causal_conv1d import causal_conv1d
from pallas_kernels.delta_rule import config as dr_config
from pallas_kernels.gated_norm import gated_rms_norm


def test_delta_rule_fwd_bwd_against_the_float64_loop():
  """Outputs (of a differentiated call too), final state and every gradient, with resets; the
  write as a direction and as a per-token scalar."""
  t = 37
  seg = tdr._segments(t, (5, 16), (30,))
  with jax.enable_x64(True):
    tdr._check(
      tdr._inputs(21, 2, t, 2, 32, 16, jnp.float32, False, "normal"),
      seg,
      16,
      1e-5,
      1e-4,
      vjp_primal=True,
    )
    tdr._check(
      tdr._inputs(22, 2, t, 2, 32, 16, jnp.float32, True, "strong", scalar_write=True),
      None,
      16,
      1e-5,
      1e-4,
      vjp_primal=True,
    )
    # K in key tiles and the wide V blocks: the path K above 128 takes by default
    tdr._check(
      tdr._inputs(23, 2, t, 1, 64, 64, jnp.float32, False, "normal"),
      seg,
      16,
      1e-5,
      1e-4,
      config=dr_config.DeltaRuleConfig(block_k=16, wide_block_v=16, wide_block_v_parallel=32),
    )


def test_gains_fwd_bwd_against_the_float64_loop():
  """The diag and iso gains (the iso one over per-token scalars): gain, final variance and
  every gradient, several chunks with resets."""
  with jax.enable_x64(True):
    for diag in (True, False):
      tg._run(diag, 33, 16, 4.0, 1e-3, True, (5, 6, 31), jnp.float32, 1e-5, 1e-4)


def _values_and_grads(fn, args):
  out, vjp = jax.vjp(fn, *args)
  rng = np.random.default_rng(0)
  cts = jax.tree.map(lambda o: jnp.asarray(rng.normal(size=o.shape), o.dtype), out)
  return jax.tree.leaves((out, vjp(cts)))


def test_layer_kernels_give_their_x64_off_values():
  """The conv (+ L2), the gated norm and the fused-front gains, bf16 and fp32 data: with x64 on,
  the values and gradients they give with it off."""
  rng = np.random.default_rng(3)
  b, t, h, kd = 2, 21, 2, 16
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  x, w, cache = f32(b, t, h, kd), f32(4, h, kd), f32(b, 3, h, kd)
  o, g, nw = f32(b, t, h, kd), f32(b, t, h, kd), 1 + 0.1 * f32(kd)
  f, dtb, alog = f32(b, t, h, kd), 0.1 * f32(h, kd), 0.1 * f32(h)
  om, om_iso, r = f32(b, t, h, kd), f32(b, t, h), f32(b, t, h)
  mu, p0 = jnp.full((h,), 8.0, jnp.float32), 1 + jnp.abs(f32(b, h, kd))
  seg = jnp.asarray((np.arange(t)[None] >= np.array([[7], [30]])).astype(np.int32))
  cases = {
    "conv_l2": (
      lambda x, w, c: causal_conv1d(x.astype(jnp.bfloat16), w, c, seg, normalize=True),
      (x, w, cache),
    ),
    "conv": (lambda x, w, c: causal_conv1d(x, w, c, seg, activation=False), (x, w, cache)),
    "norm": (lambda o, g, nw: gated_rms_norm(o, g, nw, 1e-6), (o, g, nw)),
    "diag_fused": (
      lambda k, f, om, r: kdn_gain.diag_gain_fused(
        k.astype(jnp.bfloat16), f, dtb, alog, om, r, 0.01, mu, p0, seg, gain_dtype=jnp.bfloat16
      ),
      (x, f, om, r),
    ),
    "iso_fused": (
      lambda k, f, om, r: kdn_gain.iso_gain_fused(
        k, f, dtb, alog, om, r, 0.01, mu, p0[..., 0], seg
      ),
      (x, f, om_iso, r),
    ),
  }
  for name, (fn, args) in cases.items():
    want = _values_and_grads(fn, args)
    with jax.enable_x64(True):
      got = _values_and_grads(fn, args)
    assert len(got) == len(want), name
    for a, c in zip(got, want):
      assert a.dtype == c.dtype and a.shape == c.shape, name
      np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-6, atol=1e-6, err_msg=name
      )
