"""Accuracy of pallas_kernels.delta_rule (CPU interpret mode) against a float64 token loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule
from pallas_kernels.delta_rule import config as dr_config

NAMES = ("q", "k", "v", "log_alpha", "write", "initial_state")


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-300)))


def _oracle(q, k, v, la, w, s0, scale, seg):
  """Float64 token loop (lax.scan), resets at segment starts. Call under enable_x64."""
  if la.ndim == 3:
    la = la[..., None]
  if w.ndim == 3:  # a per-token scalar write: write = beta k
    w = w[..., None] * k
  b, t = q.shape[:2]
  if seg is None:
    reset = jnp.zeros((b, t), bool)
  else:
    reset = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)

  def step(s, xs):
    qt, kt, vt, lat, wt, rt = xs
    s = jnp.where(rt[:, None, None, None], s0, s)
    s = jnp.exp(lat)[..., None] * s
    delta = vt - jnp.einsum("bhkv,bhk->bhv", s, kt)
    s = s + wt[..., None] * delta[..., None, :]
    return s, scale * jnp.einsum("bhkv,bhk->bhv", s, qt)

  la = jnp.broadcast_to(la, k.shape)
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, la, w, reset))
  s, o = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(o, 0, 1), s


def _inputs(seed, b, t, h, kd, vd, dtype, scalar_decay, decay, write_scale=0.5, scalar_write=False):
  rng = np.random.default_rng(seed)
  nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = nrm(rng.normal(size=(b, t, h, kd)))
  k = nrm(rng.normal(size=(b, t, h, kd)))
  v = rng.normal(size=(b, t, h, vd))
  w = write_scale * rng.uniform(0, 1, size=(b, t, h, 1)) * k + 0.05 * rng.normal(size=k.shape)
  if scalar_write:  # beta [B, T, H]: write = beta k
    w = rng.uniform(0.05, 1.0, size=(b, t, h))
  shape = (b, t, h) if scalar_decay else (b, t, h, kd)
  if decay == "strong":
    la = np.full(shape, -20.0)
  else:
    la = -np.abs(rng.normal(size=shape)) * 0.3
  s0 = 0.3 * rng.normal(size=(b, h, kd, vd))
  arrs = [q, k, v, la, w]
  arrs = [jnp.asarray(x, jnp.float32).astype(dtype) for x in arrs]
  return arrs + [jnp.asarray(s0, jnp.float32)]


def _segments(t, *rows):
  """segment_ids [len(rows), t]: row i's segment number goes up by one at each start in rows[i]."""
  seg = np.zeros((len(rows), t), np.int32)
  for i, starts in enumerate(rows):
    for start in starts:
      seg[i, start:] += 1
  return seg


def _check(args, seg, chunk, tol_fwd, tol_grad, scale=0.7, vjp_primal=False, config=None):
  """Outputs, final state and every gradient against the float64 loop; with vjp_primal also the
  outputs of a differentiated call (the custom_vjp's forward, which saves residuals)."""
  segj = None if seg is None else jnp.asarray(seg, jnp.int32)
  f = jax.jit(lambda *a: delta_rule(*a[:5], scale, a[5], segj, chunk_size=chunk, config=config))
  o, s = f(*args)
  assert o.dtype == args[0].dtype and o.shape == args[2].shape
  assert s.dtype == jnp.float32 and s.shape == args[5].shape
  rng = np.random.default_rng(123)
  ct_o = rng.normal(size=o.shape)
  ct_s = rng.normal(size=s.shape)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in args]
    seg64 = None if seg is None else jnp.asarray(seg)
    ro, rs = _oracle(*a64, scale, seg64)

    def loss64(*a):
      o64, s64 = _oracle(*a, scale, seg64)
      return jnp.sum(o64 * ct_o) + jnp.sum(s64 * ct_s)

    rg = jax.jit(jax.grad(loss64, argnums=tuple(range(6))))(*a64)
    ro, rs, rg = np.asarray(ro), np.asarray(rs), [np.asarray(x) for x in rg]
  assert _rel(o, ro) <= tol_fwd, ("o", _rel(o, ro))
  assert _rel(s, rs) <= tol_fwd, ("S_final", _rel(s, rs))
  if vjp_primal:
    o_d, s_d = jax.jit(lambda *a: jax.vjp(f, *a)[0])(*args)
    assert _rel(o_d, ro) <= tol_fwd, ("o (differentiated call)", _rel(o_d, ro))
    assert _rel(s_d, rs) <= tol_fwd, ("S_final (differentiated call)", _rel(s_d, rs))

  def loss(*a):
    o, s = f(*a)
    return jnp.sum(o.astype(jnp.float32) * ct_o) + jnp.sum(s * ct_s)

  g = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
  errs = {n: _rel(x, y) for n, x, y in zip(NAMES, g, rg)}
  for n, e in errs.items():
    assert e <= tol_grad, (n, errs)
  return errs


# The chunk (16) at T = 1, partial chunks, both decay forms and resets inside chunks is held to
# the float64 loop through the ops (tests/ops_cases.py, impl="pallas"); here: longer sequences,
# callers' longer chunk_size (the kernels run 16) and the gradients under strong decay.
@pytest.mark.parametrize(
  "t,chunk,scalar_decay,decay,segs",
  [
    (65, 64, False, "normal", None),  # T = 4 chunks + 1, per-channel decay
    (40, 16, False, "strong", None),  # log_alpha = -20, several chunks
    (37, 32, False, "strong", (5, 30)),
  ],
)
def test_delta_rule_fp32(t, chunk, scalar_decay, decay, segs):
  """The default config, chunk_size given by the caller."""
  args = _inputs(t, 1, t, 2, 64, 64, jnp.float32, scalar_decay, decay)
  seg = None if segs is None else _segments(t, segs)
  _check(args, seg, chunk, 1e-5, 1e-4)


@pytest.mark.parametrize(
  "variant",
  [  # (the shipped default: through the ops, ops_cases)
    # (orthogonal options share a case: each case is one interpret-mode compile of fwd + bwd)
    dict(block_v=32, block_v_parallel=64, pair_heads=1),
    dict(block_v=64, block_v_parallel=32),
    # the reverse cumsum's loads in blocks of 3 (a remainder in every program)
    dict(cumsum_block=3),
    # (6 heads: programs of gcd(4, 6) = 2 heads); the reverse cumsum as a plain row loop
    dict(pair_heads=4, cumsum_block=1),
    # the decayed operands (default) read by state pass and output kernel in two V blocks each
    dict(block_v=32, block_v_parallel=32),
    # K in key tiles of 16 (pair, WY, intra backward) and the wide V blocks of the [K, V] ones
    dict(block_k=16, wide_block_v=16, wide_block_v_parallel=32),
  ],
)
def test_delta_rule_kernel_variants(variant):
  """Every kernel option (V blocks of the serial and parallel kernels, heads per token-parallel
  program, the reverse cumsum's loads in other blocks) is exact."""
  t = 45
  # (6 heads where the option concerns the pair kernel's programs of several heads)
  heads = 6 if "pair_heads" in variant else 1
  args = _inputs(5, 2, t, heads, 64, 64, jnp.float32, False, "normal")
  # resets inside a chunk, on a chunk's last row, on the next chunk's first row
  seg = _segments(t, (20, 31, 32), (38,))
  cfg = dr_config.DeltaRuleConfig(**variant)
  _check(args, seg, 32, 1e-5, 1e-4, config=cfg)


@pytest.mark.parametrize(
  "variant,dtype,scalar_decay",
  [
    ({}, jnp.float32, False),
    # key tiles: beta's gradient summed over them
    (dict(block_k=16), jnp.float32, False),
    ({}, jnp.bfloat16, True),  # GDN's: with a [B, T, H] decay
    ({}, jnp.bfloat16, False),  # KDA's: per-channel decay
  ],
)
def test_delta_rule_scalar_write(variant, dtype, scalar_decay):
  """write given as a per-token scalar beta [B, T, H] (write = beta k, formed in the pair kernel
  and the intra backward; beta's gradient <dw, k> and k's share beta dw summed there) against
  the float64 loop on beta k: outputs, final state and every gradient (beta's, k's), with
  resets inside and at the start of a chunk, T not a multiple of the chunk."""
  t = 45
  seg = _segments(t, (16,), (21,))
  tol = (1e-5, 1e-4) if dtype == jnp.float32 else (5e-3, 1e-2)
  args = _inputs(9, 2, t, 2, 64, 32, dtype, scalar_decay, "normal", scalar_write=True)
  assert args[4].shape == (2, t, 2)
  cfg = dr_config.DeltaRuleConfig(**variant)
  _check(args, seg, 16, *tol, vjp_primal=True, config=cfg)


@pytest.mark.parametrize("write_g", [True, False])
def test_pair_kernel_outputs(write_g):
  """The pair kernel's g (or, without write_g, g_last: g at each chunk's last row), formed from
  log_alpha, against a cumsum restarted at chunk starts and resets; its Kbar and Qbar are
  k exp(g) and scale q exp(g) in the operand dtype (bf16 for 'fast' dots)."""
  from pallas_kernels import common  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import intra, segment_arrays  # pylint: disable=g-import-not-at-top

  t, scale = 48, 0.3
  q, k, _, la, w, _ = _inputs(15, 2, t, 4, 64, 32, jnp.bfloat16, False, "normal")
  starts, _, pid = segment_arrays(jnp.asarray(_segments(t, (5, 16), (30,))), 2, t, t, 16)
  cfg = dr_config.DeltaRuleConfig()
  kw = dict(chunk=16, scale=scale, interpret=True, cfg=cfg, cfg_prec="fast")
  got = intra.pair_forward(q, k, w, la, pid, write_g=write_g, **kw)
  g = common.segmented_cumsum(la.astype(jnp.float32), starts[:, :, None, None], axis=1)
  assert got.kbar.dtype == got.qbar.dtype == jnp.bfloat16
  assert (got.g is not None) == write_g and (got.g_last is None) == write_g
  if write_g:
    np.testing.assert_allclose(got.g, g, rtol=1e-6, atol=1e-6)
  else:
    np.testing.assert_allclose(got.g_last, g[:, 15::16], rtol=1e-6, atol=1e-6)
  e = np.exp(np.asarray(g, np.float64))
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(f64(got.kbar), f64(k) * e, rtol=8e-3, atol=1e-6)
  np.testing.assert_allclose(f64(got.qbar), scale * f64(q) * e, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize(
  "t,scalar_decay,segs,scalar_write,decay",
  [
    # a forward-only call keeps g_last alone; the scalar write; resets inside a chunk, on its
    # last row, on the next's first
    (45, False, True, True, "normal"),
    (45, False, True, False, "normal"),  # a [B, T, H, K] write (the diag KDN's)
    (40, True, True, False, "strong"),  # log-decay -20 per token, [B, T, H] decay
    (1, False, False, False, "normal"),  # T = 1
  ],
)
def test_forward_passes(t, scalar_decay, segs, scalar_write, decay):
  """g formed by the pair kernel, Kbar and Qbar written by it and read by the WY and output
  kernels in place of k, q and g: outputs of the primal and of a differentiated call, final
  state and every gradient against the float64 loop."""
  args = _inputs(16, 2, t, 2, 64, 32, jnp.float32, scalar_decay, decay, scalar_write=scalar_write)
  seg = _segments(t, (20, 31, 32), (9,)) if segs else None
  _check(args, seg, 16, 1e-5, 1e-4, vjp_primal=True)


def test_forward_only_call_holds_no_fp32_g():
  """A call that is not differentiated holds no fp32 [B, T, H, K] array: no g (the pair kernel
  writes only its chunk-last rows for the state pass), Kbar and Qbar in bf16 for bf16 data."""
  b, t, h, kd = 2, 45, 2, 64
  args = _inputs(17, b, t, h, kd, 32, jnp.bfloat16, False, "normal")
  seg = jnp.asarray(_segments(t, (20,), (9, 33)))
  f = jax.jit(lambda *a: delta_rule(*a[:5], 0.7, a[5], seg, chunk_size=16))
  assert f"f32[{b},48,{h},{kd}]" not in str(jax.make_jaxpr(f)(*args))  # (T padded to 48)


def test_fused_step_without_segments():
  """The fused step on the path the forward benchmark times (no segments): the primal, which
  stores no states (fused), and a differentiated call's forward (state pass and output kernel)."""
  args = _inputs(8, 2, 45, 1, 64, 64, jnp.float32, False, "normal")
  _check(args, None, 16, 1e-5, 1e-4, vjp_primal=True)


@pytest.mark.parametrize("variant", [{}, dict(pair_heads=1)])
@pytest.mark.parametrize("segments", [False, True])
def test_delta_rule_intra_backward(segments, variant):
  """The token-parallel intra backward (programs of pair_heads heads; its direct log-decay terms
  summed by the reverse cumsum) against the float64 loop, with and without resets; V != K. The resets fall on a chunk's last row, on the next chunk's first row and
  inside a chunk, next to a chunk without one (tiles.by_reset: the segment-free bodies)."""
  t = 45
  seg = _segments(t, (31, 32), (38,)) if segments else None
  heads = 6  # programs of gcd(pair_heads, 6) heads: 2 by default, 1 with pair_heads=1
  cfg = dr_config.DeltaRuleConfig(**variant)
  _check(
    _inputs(6, 2, t, heads, 64, 32, jnp.float32, False, "normal"),
    seg,
    16,
    1e-5,
    1e-4,
    config=cfg,
  )


def test_delta_rule_bf16_operand_dots():
  """bf16 dot operands (for bf16 data) stay within the bf16 bounds over 10 chunks, bf16 states
  included (the outputs of a differentiated call checked too)."""
  seg = np.zeros((1, 150), np.int32)
  seg[:, 70:] = 1
  _check(
    _inputs(11, 1, 150, 2, 64, 64, jnp.bfloat16, False, "normal"),
    seg,
    32,
    5e-3,
    1e-2,
    vjp_primal=True,
  )


def test_delta_rule_bf16_states():
  """bf16_states (saved states and state gradients in bf16 under bf16-operand dots; the default)
  stays within the bf16 bounds with segments; fp32 states (bf16_states=False) too."""
  seg = np.zeros((1, 150), np.int32)
  seg[:, 70:] = 1
  for extra in (
    dict(bf16_states=True),
    dict(bf16_states=False),
  ):
    cfg = dr_config.DeltaRuleConfig(**extra)
    _check(
      _inputs(13, 1, 150, 2, 64, 64, jnp.bfloat16, False, "normal"), seg, 32, 5e-3, 1e-2, config=cfg
    )


@pytest.mark.parametrize(
  "kd,vd,match",
  [
    (384, 16, r"delta_rule: K must be <= 256 and one of \(16, 32, 64, 128, 256\), got K=384"),
    (16, 48, "delta_rule: V must be <= 256 .* got V=48"),
  ],
)
def test_delta_rule_unsupported_width(kd, vd, match):
  """One line naming the width; kdn_jax.ops pads and tiles other widths onto these."""
  x, v = jnp.zeros((1, 4, 1, kd)), jnp.zeros((1, 4, 1, vd))
  with pytest.raises(ValueError, match=match):
    delta_rule(x, x, v, x, x, 1.0, jnp.zeros((1, 1, kd, vd)))


def test_delta_rule_tpu_interpret_matches():
  """Mosaic-TPU interpret mode (the only TPU validation available here) == generic interpret."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  args = _inputs(3, 1, 20, 1, 16, 16, jnp.float32, False, "normal")
  seg = jnp.asarray(np.array([[0] * 9 + [1] * 11]), jnp.int32)
  o1, s1 = delta_rule(
    *args[:5], 0.5, args[5], seg, chunk_size=16, interpret=pltpu.InterpretParams()
  )
  o2, s2 = delta_rule(*args[:5], 0.5, args[5], seg, chunk_size=16, interpret=True)
  assert _rel(o1, o2) < 1e-6 and _rel(s1, s2) < 1e-6


def test_delta_rule_precision_argument():
  """precision defaults from the dtype ('exact' for fp32, 'fast' for bf16) and bad names are refused."""
  from pallas_kernels import precision_for  # pylint: disable=g-import-not-at-top

  assert precision_for(jnp.float32) == "exact" and precision_for(jnp.bfloat16) == "fast"
  args = _inputs(2, 1, 8, 1, 16, 16, jnp.float32, False, "normal")
  with pytest.raises(ValueError, match="precision='tf16'"):
    delta_rule(*args[:5], 0.5, args[5], precision="tf16")
  o1, _ = delta_rule(*args[:5], 0.5, args[5], chunk_size=16)
  o2, _ = delta_rule(*args[:5], 0.5, args[5], chunk_size=16, precision="exact")
  np.testing.assert_array_equal(o1, o2)


@pytest.mark.parametrize(
  "bad",
  [
    dict(block_v=48),
    dict(block_v_parallel=96),
    dict(wide_block_v=24),
    dict(block_k=8),
    dict(max_chunk=0),
    dict(pair_heads=3),
    dict(num_warps_intra_bwd=0),
  ],
)
def test_delta_rule_config_rejects_bad_values(bad):
  with pytest.raises(ValueError, match="DeltaRuleConfig." + next(iter(bad))):
    dr_config.DeltaRuleConfig(**bad)


def test_chunk_length():
  """The Triton kernels run chunks of 16 whatever the caller's chunk_size and refuse a config
  with another max_chunk; the TPU kernels take chunk_size capped by max_chunk and by T (rounded
  up to a power of two), 16 at least."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  from pallas_kernels.delta_rule import chunk_length  # pylint: disable=g-import-not-at-top

  cfg = dr_config.DeltaRuleConfig()
  for interpret in (True, False):
    assert chunk_length(cfg, 64, 300, interpret) == 16
  with pytest.raises(ValueError, match="max_chunk=32"):
    chunk_length(dr_config.DeltaRuleConfig(max_chunk=32), 64, 300, interpret=True)
  tpu, big = pltpu.InterpretParams(), dr_config.DeltaRuleConfig(max_chunk=64)
  assert chunk_length(big, 64, 300, tpu) == 64
  assert chunk_length(big, 32, 300, tpu) == 32
  assert chunk_length(big, 64, 20, tpu) == 32
  assert chunk_length(big, 64, 1, tpu) == 16
