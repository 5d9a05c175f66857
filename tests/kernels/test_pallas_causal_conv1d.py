"""pallas_kernels.causal_conv1d (CPU interpret mode) against the layer's plain-JAX short conv
(kdn_jax.layers.short_conv.ShortConv): outputs and the gradients of x, weight and cache, with
packed segments, T = 1, T not a multiple of the block, several blocks (the rows a block takes
from its neighbours), bf16 inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdn_jax.layers.short_conv import ShortConv
from pallas_kernels.causal_conv1d import causal_conv1d
from pallas_kernels.causal_conv1d import config as conv_config


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30)))


def _reference(x, w, cache, seg, activation, normalize=False):
  conv = ShortConv(w.shape[1:], w.shape[0], activation=activation, dtype=x.dtype, rngs=nnx.Rngs(0))
  conv.weight[...] = w
  # (normalize: the plain path normalises the rounded conv output in fp32; the layer then rounds)
  return conv(x, cache, seg, normalize=normalize)[0].astype(x.dtype)


def _conv_config(block_t):
  """The case's ConvConfig (None: the tuned one; an int: block_t; a dict: the overrides)."""
  if block_t is None:
    return None
  return conv_config.ConvConfig(**(block_t if isinstance(block_t, dict) else dict(block_t=block_t)))


@pytest.mark.parametrize(
  "t,segs,dtype,activation,block_t,normalize",
  [
    (37, (1, 2, 20), jnp.float32, True, None, False),  # segments (one of length 1), T % block != 0
    # 4 blocks of 16: segments ending at / starting at / crossing block boundaries, of length 1
    # and 2, the last one (length 1) continued by the padding; rows L2-normalised (q and k)
    (53, (1, 2, 14, 16, 31, 33, 48, 52), jnp.float32, True, 16, True),
    (53, None, jnp.float32, False, 16, False),  # several blocks, no segments, no SiLU
    # the row loops' loads in blocks of 3 (ConvConfig.load_block: a remainder in every block),
    # and as plain loops (default: blocks of 8)
    (53, (1, 2, 14, 16, 31, 33, 48, 52), jnp.float32, True, dict(block_t=16, load_block=3), True),
    (53, None, jnp.float32, False, dict(block_t=16, load_block=1), False),
    (20, (9,), jnp.bfloat16, True, None, False),  # the layer's compute dtype
    (20, (9,), jnp.bfloat16, True, None, True),
    (1, None, jnp.bfloat16, True, None, False),  # T = 1: the cache alone
    (5, None, jnp.float32, False, None, True),  # no SiLU, normalised
  ],
)
def test_causal_conv1d_matches_short_conv(t, segs, dtype, activation, block_t, normalize):
  b, h, kd, width = 2, 2, 16, 4
  rng = np.random.default_rng(t)
  x = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32).astype(dtype)
  w = jnp.asarray(rng.normal(size=(width, h, kd)) / 2, jnp.float32)
  cache = jnp.asarray(rng.normal(size=(b, width - 1, h, kd)), jnp.float32)
  seg = None
  if segs is not None:
    seg = np.zeros((b, t), np.int32)
    for s in segs:
      seg[1:, s:] += 1  # batch row 0: one segment; row 1: several
    seg = jnp.asarray(seg)
  ct = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

  def run(fn):
    def f(x, w, cache):
      y, vjp = jax.vjp(lambda *a: fn(*a, seg, activation, normalize), x, w, cache)
      return y, vjp(ct.astype(y.dtype))

    return jax.jit(f)(x, w, cache)

  cfg = _conv_config(block_t)
  kernel = lambda x, w, c, s, a, n: causal_conv1d(x, w, c, s, activation=a, normalize=n, config=cfg)
  (y, grads), (y_ref, grads_ref) = run(kernel), run(_reference)
  tol = 1e-6 if dtype == jnp.float32 else 4e-3  # bf16: one rounding of the same fp32 sums
  assert y.dtype == y_ref.dtype and _rel(y, y_ref) <= tol, _rel(y, y_ref)
  for name, g, r in zip(("x", "weight", "cache"), grads, grads_ref):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    assert _rel(g, r) <= (1e-5 if dtype == jnp.float32 else 4e-3), (name, _rel(g, r))


def test_conv_and_gated_norm_run_per_shard():
  """Under a (data, tensor)-sharded jit the conv and gated-norm kernels run on their batch / head
  shards (no operand gathered) and give the one-device gradients."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_kernels.gated_norm import gated_rms_norm

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  b, t, h, kd = 4, 20, 4, 16
  rng = np.random.default_rng(0)
  x, g = (jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=(4, h, kd)), jnp.float32)
  cache = jnp.asarray(rng.normal(size=(b, 3, h, kd)), jnp.float32)
  nw = jnp.asarray(1 + rng.normal(size=(kd,)), jnp.float32)
  seg = jnp.asarray((np.arange(t)[None] >= np.array([[3], [9], [20], [15]])).astype(np.int32))

  def loss(x, g, w, cache, nw, seg):
    y = gated_rms_norm(causal_conv1d(x, w, cache, seg), g, nw, 1e-6)
    return jnp.sum(y * jnp.cos(y))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  sharded = (
    put(x, "data", None, "tensor"),
    put(g, "data", None, "tensor"),
    put(w, None, "tensor"),
    put(cache, "data", None, "tensor"),
    put(nw),
    put(seg, "data"),
  )
  want = grad(x, g, w, cache, nw, seg)
  got = grad(*sharded)
  for name, a, r in zip(("x", "gate", "weight", "cache", "norm weight"), got, want):
    np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6, err_msg=name)
  assert "all-gather" not in grad.lower(*sharded).compile().as_text()


@pytest.mark.parametrize(
  "dtype,scale",
  [
    (jnp.bfloat16, 1.0),  # the layer's dtype: the forward's rounding of the conv output
    (jnp.float32, 1e-4),  # |y|^2 ~ 1e-7 K, next to the normalisation's eps = 1e-6
    (jnp.bfloat16, 1e-4),
  ],
)
def test_normalized_conv_against_fp32_with_the_forward_rounding(dtype, scale):
  """normalize=True against an fp32 composition that rounds the conv output to x's dtype in the
  forward only (z + stop_gradient(round(z) - z)) and keeps every cotangent in fp32: what the
  kernel computes, up to the one rounding of its outputs (and of the cache gradient) to x's
  dtype. Tighter than the test above for bf16, where the composition also rounds the
  normalisation's cotangent; and eps in play at scale 1e-4."""
  b, t, h, kd, width = 2, 37, 2, 16, 4
  rng = np.random.default_rng(5)
  x = (jnp.asarray(rng.normal(size=(b, t, h, kd)) * scale, jnp.float32)).astype(dtype)
  w = jnp.asarray(rng.normal(size=(width, h, kd)) / 2, jnp.float32)
  cache = jnp.asarray(rng.normal(size=(b, width - 1, h, kd)) * scale, jnp.float32)
  seg = jnp.asarray(np.repeat([[0] * 9 + [1] * 20 + [2] * 8], b, 0), jnp.int32)
  # (the cotangent in x's dtype on both sides: the kernel's output is in it)
  ct = jnp.asarray(rng.normal(size=x.shape), jnp.float32).astype(dtype).astype(jnp.float32)

  def reference(x, w, cache):
    conv = ShortConv((h, kd), width, dtype=jnp.float32, rngs=nnx.Rngs(0))
    conv.weight[...] = w
    xp = jnp.concatenate([cache.astype(dtype).astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    from kdn_jax.layers.short_conv import l2_normalize, positions_in_segment  # pylint: disable=g-import-not-at-top

    z = jax.nn.silu(conv._conv(xp, t, positions_in_segment(seg)))  # pylint: disable=protected-access
    z = z + jax.lax.stop_gradient(z.astype(dtype).astype(jnp.float32) - z)
    return l2_normalize(z)

  def run(fn, cast):
    y, vjp = jax.vjp(fn, x.astype(cast), w, cache)
    return y, vjp(ct.astype(y.dtype))

  y, grads = jax.jit(lambda: run(lambda *a: causal_conv1d(*a, seg, normalize=True), dtype))()
  y_ref, grads_ref = jax.jit(lambda: run(reference, jnp.float32))()
  tol = 1e-5 if dtype == jnp.float32 else 2.5e-3  # bf16: the outputs' one rounding
  assert _rel(y, y_ref) <= tol, _rel(y, y_ref)
  for name, g, r in zip(("x", "weight", "cache"), grads, grads_ref):
    assert _rel(g, r) <= (1e-5 if name == "weight" else tol), (name, _rel(g, r))
