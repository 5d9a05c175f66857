"""The Mosaic-TPU kernels (BlockSpec tiles, carried state in VMEM scratch) in TPU interpret mode
on CPU against the float64 oracles: outputs, final states and every gradient, at two block
sizes, T not a multiple of the block, segments; and their VMEM budgets at a real size."""

import jax
import jax.numpy as jnp
import kdn_oracle
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_pallas_gain import _diag_oracle, _inputs, _iso_oracle, _rel

from pallas_kernels import diag_gain, iso_gain, tpu_common
from pallas_kernels.kdn_gain import tpu as gain_tpu

TPU = pltpu.InterpretParams()


def _outputs_and_grads(f, args, out_shapes, seed):
  """f(*args), and the gradients of <f(*args), cts> for random cts, in one jit (eager TPU
  interpret mode runs op by op: several times slower)."""
  rng = np.random.default_rng(seed)
  cts = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in out_shapes)

  @jax.jit
  def run(args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(cts)

  out, grads = run(tuple(args))
  return out, grads, cts


def _segments(b, t, starts):
  seg = np.zeros((b, t), np.int32)
  for s in starts:
    seg[0, s:] += 1  # batch row 0 has resets, row 1 none
  return jnp.asarray(seg)


# (diag, T, block, dtype, segment starts in row 0): blocks 16 and 32, T never a multiple; mild
# decays, so the variance (and its gradient) carries across blocks. (The iso gain at block 16
# in f32 runs in test_iso_kdn_impl_pallas_runs_the_tpu_kernels.)
GAIN_CASES = [
  (True, 37, 16, jnp.float32, (5, 21)),
  (False, 45, 32, jnp.bfloat16, (33,)),  # 16-row groups (the bf16 sublane tile)
]


@pytest.mark.parametrize("diag,t,block,dtype,starts", GAIN_CASES)
def test_gain_tpu_matches_oracle(diag, t, block, dtype, starts):
  b, h, kd = 2, 2, 16
  k, la, om, r, p0 = _inputs(t, b, t, h, kd, diag, dtype, None, False)
  mu = jnp.asarray([kd, 4.0 * kd], jnp.float32)
  seg = _segments(b, t, starts) if starts else None
  fn = diag_gain if diag else iso_gain
  f = lambda k, la, om, r, mu, p0: fn(k, la, om, r, mu, p0, seg, chunk_size=block, interpret=TPU)
  args = (k, la, om, r, mu, p0)
  (gain, pf), grads, cts = _outputs_and_grads(f, args, (la.shape if diag else r.shape, p0.shape), 1)
  oracle = _diag_oracle if diag else _iso_oracle
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in args]
    ref, ref_vjp = jax.vjp(lambda *a: oracle(*a[:5], a[5], seg), *a64)
    ref_grads = ref_vjp(tuple(jnp.asarray(c, jnp.float64) for c in cts))
  tol_f, tol_g = (1e-5, 1e-4) if dtype == jnp.float32 else (5e-3, 1e-2)
  assert _rel(gain, ref[0]) <= tol_f and _rel(pf, ref[1]) <= tol_f
  names = ("k", "log_alpha", "omega", "r", "info_scale", "p0")
  errs = {n: _rel(x, y) for n, x, y in zip(names, grads, ref_grads)}
  assert all(e <= tol_g for e in errs.values()), errs


# (T, chunk, K, V, forward V block, segment starts in row 0, scalar decay)
DELTA_CASES = [
  (37, 16, 16, 32, 16, (5, 16, 30), False),  # two V blocks in the forward
  (45, 32, 32, 16, None, (), True),  # no segments: the kernel's has_seg=False
]


@pytest.mark.parametrize("t,chunk,kd,vd,block_v,starts,scalar", DELTA_CASES)
def test_delta_rule_tpu_matches_oracle(t, chunk, kd, vd, block_v, starts, scalar, monkeypatch):
  """Outputs, final state and the gradients of q, k, v, log_alpha, write and the initial state
  (tpu_forward.py + tpu_backward.py through delta_rule's custom_vjp)."""
  from pallas_kernels import delta_rule  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import config as dr_config  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import tpu_forward  # pylint: disable=g-import-not-at-top

  if block_v:
    monkeypatch.setattr(tpu_forward, "BLOCK_V", block_v)
  dtype = jnp.float32
  b, h = 2, 2
  rng = np.random.default_rng(t)
  q, k = (rng.normal(size=(b, t, h, kd)) / np.sqrt(kd) for _ in range(2))
  v = rng.normal(size=(b, t, h, vd))
  la = -np.abs(rng.normal(size=(b, t, h) if scalar else (b, t, h, kd))) * 0.3
  # One strong decay (the ratios must never form exp(-g)); elsewhere mild, so the state and its
  # gradient carry across chunks.
  la = la * 0.3
  la[:, 3] = -20.0
  w = rng.normal(size=(b, t, h, kd)) / np.sqrt(kd) * 0.5
  s0 = rng.normal(size=(b, h, kd, vd))
  args = [jnp.asarray(x, jnp.float32).astype(dtype) for x in (q, k, v, la, w)] + [
    jnp.asarray(s0, jnp.float32)
  ]
  seg = _segments(b, t, starts) if starts else None
  cfg = dr_config.DeltaRuleConfig(max_chunk=chunk)
  f = lambda q, k, v, la, w, s0: delta_rule(
    q, k, v, la, w, 0.7, s0, seg, chunk_size=chunk, interpret=TPU, config=cfg
  )
  (o, sfin), grads, cts = _outputs_and_grads(f, args, (v.shape, s0.shape), 2)

  def oracle(q, k, v, la, w, s0):
    la = la if not scalar else jnp.broadcast_to(la[..., None], k.shape)
    return kdn_oracle.delta_rule(q, k, v, la, w, s0, 0.7, seg)

  with jax.enable_x64(True):
    x64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in args]
    (ro, rs), ref_vjp = jax.vjp(oracle, *x64)
    ref_grads = ref_vjp(tuple(jnp.asarray(c, jnp.float64) for c in cts))
  assert _rel(o, ro) <= 1e-5 and _rel(sfin, rs) <= 1e-5, (_rel(o, ro), _rel(sfin, rs))
  names = ("q", "k", "v", "log_alpha", "write", "initial_state")
  errs = {n: _rel(x, y) for n, x, y in zip(names, grads, ref_grads)}
  assert all(e <= 1e-4 for e in errs.values()), errs


def test_tile_bytes_pad_to_the_tpu_layout():
  """(8 | 16 sublanes, 128 lanes) tiles: a [1, K] f32 row takes a whole (8, 128) tile; 16-bit
  rows pack in pairs (16-row tiles); leading dims multiply."""
  assert tpu_common.tile_bytes((1, 16), jnp.float32) == 8 * 128 * 4
  assert tpu_common.tile_bytes((16, 1), jnp.bfloat16) == 16 * 128 * 2
  assert tpu_common.tile_bytes((24, 130), jnp.float32) == 24 * 256 * 4
  assert tpu_common.tile_bytes((3, 8, 128), jnp.int32) == 3 * 8 * 128 * 4
  assert tpu_common.Block("x", (8, 128), jnp.float32).bytes == 2 * 8 * 128 * 4  # 2 buffers


def test_every_tpu_kernel_fits_16mib_of_vmem_at_real_size():
  """At B=4, T=16k, H=16, K=V=128 bf16 every TPU kernel's live VMEM (tiles double-
  buffered + scratch) is under 16 MiB, at the default blocks and the largest chunk."""
  from pallas_kernels import tpu_vmem  # pylint: disable=g-import-not-at-top

  for chunk in (None, 64):
    got = tpu_vmem.budgets(4, 16384, 16, 128, 128, jnp.bfloat16, chunk=chunk)
    assert len(got) == 6 and all(0 < n < 16 * 2**20 for n in got.values()), got
  # The budget does not grow with T (only the grid does).
  assert tpu_vmem.budgets(4, 1024, 16, 128, 128, jnp.bfloat16) == tpu_vmem.budgets(
    4, 16384, 16, 128, 128, jnp.bfloat16
  )


def test_iso_kdn_impl_pallas_runs_the_tpu_kernels():
  """The wiring: ops.iso_kdn(impl='pallas') in TPU interpret mode (what a TPU backend selects)
  runs kdn_gain/tpu.py and delta_rule/tpu_*.py, and its loss and every gradient (q, k, v,
  log_alpha, omega, r, memory, variance, info_scale) match the float64 oracle on test_ops_grad's shared
  body, with segments; 'auto' keeps the XLA chunked path on TPU."""
  import test_ops_grad as og  # pylint: disable=g-import-not-at-top
  from ops_cases import (
    make_inputs,
    make_state,
    rel_err,  # pylint: disable=g-import-not-at-top
    round_f32,
  )

  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import tpu_backward  # pylint: disable=g-import-not-at-top

  assert dispatch.PALLAS_AUTO_PLATFORMS == ("gpu",)
  b, t, vd = og.B, 37, 16  # V >= 16: the kernels' smallest width
  x = round_f32(make_inputs("iso", b, t, og.H, og.K, vd, seed=11))
  state = round_f32(dict(enumerate(make_state("iso", b, og.H, og.K, vd))))
  _, arrays = og._arrays("iso", x, (state[0], state[1]), og.H, og.K)  # + a per-head info_scale
  seg = jnp.asarray(np.array([[0] * 20 + [1] * 17, [0] * 9 + [1] * 21 + [2] * 7]), jnp.int32)
  argnums = tuple(range(len(arrays)))
  calls = []
  spied = [(tpu_backward, "delta_rule_backward"), (gain_tpu, "gain_backward")]
  real = [getattr(m, n) for m, n in spied]

  def spy(name, fn):
    return lambda *a, **k: calls.append(name) or fn(*a, **k)

  try:
    for (m, n), fn in zip(spied, real):
      setattr(m, n, spy(n, fn))
    with pltpu.force_tpu_interpret_mode(TPU):
      loss, got = jax.jit(jax.value_and_grad(og._loss_fn("iso", "pallas", seg), argnums))(
        *(jnp.asarray(a, jnp.float32) for a in arrays)
      )
  finally:
    for (m, n), fn in zip(spied, real):
      setattr(m, n, fn)
  assert sorted(calls) == ["delta_rule_backward", "gain_backward"], calls
  with jax.enable_x64(True):
    want_loss, want = jax.value_and_grad(og._oracle_loss("iso", seg, og.K), argnums)(
      *(jnp.asarray(a, jnp.float64) for a in arrays)
    )
  assert rel_err(loss, want_loss) <= 1e-5
  for name, g, w in zip(og._arg_names("iso"), got, want):
    assert rel_err(g, w) <= 1e-4, (name, rel_err(g, w))
