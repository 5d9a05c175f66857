"""The KDN gain (diagonal and isotropic) as Mosaic-TPU kernels: BlockSpec tiles, carried variance.

Same recurrence and the same entry points (`gain_forward`, `gain_backward`, same arguments and
results) as the Triton/generic kernels in kernel.py, which stay the GPU path; the two are
selected in `kdn_gain/chunk_fwd.py` (`tpu_common.use_tpu_kernels`). Per token, lane i:
    p_hat = a p + om;  den = r + sum_i p_hat_i kk_i;  gain = p_hat kx / den;
    p = p_hat / (1 + u p_hat)
(lanes as in kernel.py: diag a = exp(2 la), kx = k, kk = k^2, u = mu k^2 / r over K lanes; iso one
lane with a = mean exp(2 la), kx = 1, kk = |k|^2, u = mu |k|^2 / (K r)).

Why a different kernel on TPU: kernel.py takes whole arrays (every program indexes [b, t, h]
itself), which on a TPU would put the whole operands in VMEM. Here every operand moves through
BlockSpecs in (block_t x lanes) tiles, and
  grid = (B*H, T / block_t), dimension semantics ('parallel', 'arbitrary'):
the T-block axis is sequential and carries the variance p (the Moebius recurrence's state,
applied token by token) in VMEM scratch from one block to the next, so the forward is ONE pass
(kernel.py's chunk-product reduce kernel exists to parallelise over chunks on a GPU; a TPU core
runs the grid in order anyway). The lanes of a head are not split into lane blocks: the
denominator sums p_hat kk over all K lanes of the head every token, so a head's K lanes are one
tile (K = 128 fills the 128-lane vreg width). The backward is one reverse pass (the T-block index
map runs backwards), carrying dp and p0's gradient in scratch.

Layouts, chosen so no [B, T, H, K] operand is transposed in HBM:
  lane arrays (k, log_alpha, diag omega, diag gain and its residual, their gradients):
      [B, T, H*K] (a free reshape), block (block_t, K) at column block h;
  per-(token, head) inputs (r, iso omega): [B, T, H], block (block_t, H) (H is the full minor
      dim, so the block is legal for any H); the kernel picks column h with a one-hot lane sum;
  per-(token, head) outputs (iso gain / residual, d r, d mu, iso d omega): [B*H, T, 1] so that
      each program owns its block (XLA transposes them: 1/K of a lane array's bytes);
  reset flags [B, T, 1] int32; p0 / p_final [B*H, 1, L]; mu [H] in SMEM (one scalar per head).
Rows are read and written in aligned groups of `_ROWS` (the sublane tile: 8 rows of 32-bit,
16 of 16-bit data), the token recurrence unrolled inside a group; everything that does not
depend on the carry (lane formation, and in the backward p_hat, den, the gain's own gradient)
is computed for the whole group at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tpu_common

__all__ = ["gain_forward", "gain_backward", "forward_blocks", "backward_blocks"]

F32 = jnp.float32


def _rows(dtypes):
  """Rows per aligned load/store: the sublane tile of the narrowest dtype."""
  return 8 * max(1, 4 // min(jnp.dtype(d).itemsize for d in dtypes))


class _Layout:
  """BlockSpecs of one gain pass and the VMEM Blocks they occupy (the budget reads the same
  shapes the kernel is built from). `reverse`: T blocks visited last to first (backward)."""

  def __init__(self, nh, kd, block_t, nt, diag, reverse):
    self.nh, self.kd, self.bt, self.diag = nh, kd, block_t, diag
    self.lanes = kd if diag else 1
    self._tb = (lambda t: nt - 1 - t) if reverse else (lambda t: t)
    self.blocks = []

  def _add(self, name, shape, dtype, pipelined=True):
    self.blocks.append(tpu_common.Block(name, tuple(shape), dtype, pipelined))

  def lane(self, name, dtype):
    nh, tb = self.nh, self._tb
    self._add(name, (self.bt, self.kd), dtype)
    return pl.BlockSpec((None, self.bt, self.kd), lambda bh, t: (bh // nh, tb(t), bh % nh))

  def heads(self, name, dtype):
    nh, tb = self.nh, self._tb
    self._add(name, (self.bt, nh), dtype)
    return pl.BlockSpec((None, self.bt, nh), lambda bh, t: (bh // nh, tb(t), 0))

  def column(self, name, dtype):
    tb = self._tb
    self._add(name, (self.bt, 1), dtype)
    return pl.BlockSpec((None, self.bt, 1), lambda bh, t: (bh, tb(t), 0))

  def tokens(self, name, dtype):
    nh, tb = self.nh, self._tb
    self._add(name, (self.bt, 1), dtype)
    return pl.BlockSpec((None, self.bt, 1), lambda bh, t: (bh // nh, tb(t), 0))

  def per_lane(self, name, dtype):
    """The gain's own lanes: K lanes (diag) or one per (token, head) (iso)."""
    return self.lane(name, dtype) if self.diag else self.column(name, dtype)

  def omega(self, dtype):
    return self.lane("omega", dtype) if self.diag else self.heads("omega", dtype)

  def state(self, name):
    self._add(name, (1, self.lanes), F32)
    return pl.BlockSpec((None, 1, self.lanes), lambda bh, t: (bh, 0, 0))

  def scratch(self, name):
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

    self._add(name, (1, self.lanes), F32, pipelined=False)
    return pltpu.VMEM((1, self.lanes), F32)

  @staticmethod
  def smem():
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _head_column(x, h):
  """[R, H] -> [R, 1] float32: column h (a one-hot lane sum: exact, no dynamic lane slicing)."""
  col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(col == h, x.astype(F32), 0.0), axis=1, keepdims=True)


def _lanes(k, la, om, r, mu, h, diag):
  """A group's lane inputs from its raw rows (k, la: [R, K]; om: [R, K] diag or [R, H] iso; r:
  [R, H]; mu: this head's scalar). Same formulas as kernel._lanes, on [R, .] tiles."""
  k = k.astype(F32)
  e2 = jnp.exp(2.0 * la.astype(F32))
  r = _head_column(r, h)
  if diag:
    kk = k * k
    return dict(a=e2, om=om.astype(F32), u=mu * kk / r, kx=k, kk=kk, r=r, k=k, e2=e2)
  kd = k.shape[1]
  kk = jnp.sum(k * k, axis=1, keepdims=True)
  return dict(
    a=jnp.mean(e2, axis=1, keepdims=True),
    om=_head_column(om, h),
    u=mu * kk / (kd * r),
    kx=jnp.ones_like(kk),
    kk=kk,
    r=r,
    k=k,
    e2=e2,
  )


def _raw_grads(x, g, mu, diag):
  """The chain rule of kernel._raw_grads, kept rank 2 ([R, 1] per-token columns instead of
  rank-1 rows) for Mosaic's vreg layout. Returns (dk, dla, dom, dr, dmu)."""
  k, r = x["k"], x["r"]
  gu_r = g["u"] / r
  if diag:
    return (
      g["kx"] + 2.0 * k * (g["kk"] + mu * gu_r),
      2.0 * x["e2"] * g["a"],
      g["om"],
      g["r"] - jnp.sum(gu_r * x["u"], axis=1, keepdims=True),
      jnp.sum(gu_r * x["kk"], axis=1, keepdims=True),
    )
  kd = k.shape[1]
  return (
    2.0 * k * (g["kk"] + mu * gu_r / kd),
    (2.0 / kd) * x["e2"] * g["a"],
    g["om"],
    g["r"] - gu_r * x["u"],
    gu_r * x["kk"] / kd,
  )


def _group_slice(j, rows):
  return pl.ds(pl.multiple_of(j * rows, rows), rows)


def _forward_kernel(
  k_ref, la_ref, om_ref, r_ref, reset_ref, p0_ref, mu_ref, *rest, nh, diag, rows, save_pprev
):
  gain_ref, pprev_ref, pfin_ref, p_scr = rest if save_pprev else (rest[0], None) + rest[1:]
  bh, tb = pl.program_id(0), pl.program_id(1)
  h = bh % nh
  p0 = p0_ref[...]

  @pl.when(tb == 0)
  def _():
    p_scr[...] = p0

  mu = mu_ref[h]
  out_shape = (rows, p0.shape[1])
  row_id = lax.broadcasted_iota(jnp.int32, out_shape, 0)

  def group(j, p):
    sl = _group_slice(j, rows)
    x = _lanes(k_ref[sl, :], la_ref[sl, :], om_ref[sl, :], r_ref[sl, :], mu, h, diag)
    reset = reset_ref[sl, :] > 0
    gains = jnp.zeros(out_shape, F32)
    p_before = gains  # the variance each token starts from (the backward's residual)
    for i in range(rows):  # the serial part: one token after another
      at = slice(i, i + 1)
      p = jnp.where(reset[at], p0, p)
      p_hat = x["a"][at] * p + x["om"][at]
      den = x["r"][at] + jnp.sum(p_hat * x["kk"][at], axis=1, keepdims=True)
      gains = jnp.where(row_id == i, p_hat * x["kx"][at] / den, gains)
      p_before = jnp.where(row_id == i, p, p_before)
      p = p_hat / (1.0 + x["u"][at] * p_hat)
    gain_ref[sl, :] = gains
    if save_pprev:
      pprev_ref[sl, :] = p_before
    return p

  p = lax.fori_loop(0, gain_ref.shape[0] // rows, group, p_scr[...])
  p_scr[...] = p

  @pl.when(tb == pl.num_programs(1) - 1)
  def _():
    pfin_ref[...] = p


def _backward_kernel(
  k_ref,
  la_ref,
  om_ref,
  r_ref,
  reset_ref,
  mu_ref,
  pprev_ref,
  dgain_ref,
  dpfin_ref,
  dk_ref,
  dla_ref,
  dom_ref,
  dr_ref,
  dmu_ref,
  dp0_ref,
  dp_scr,
  dp0_scr,
  *,
  nh,
  diag,
  rows,
):
  """Reverse pass over T blocks (the index maps run backwards): dp_{t-1} = a (m dp_t + q) with
  m = d p_t / d p_hat_t = s^2 and q the gain's own share of dp_hat; at a reset dp_{t-1} goes to
  p0's gradient instead."""
  bh, step = pl.program_id(0), pl.program_id(1)
  h = bh % nh

  @pl.when(step == 0)
  def _():
    dp_scr[...] = dpfin_ref[...]
    dp0_scr[...] = jnp.zeros(dp0_scr.shape, F32)

  mu = mu_ref[h]
  lanes = dp_scr.shape[1]
  row_id = lax.broadcasted_iota(jnp.int32, (rows, lanes), 0)
  num_groups = k_ref.shape[0] // rows

  def group(jj, carry):
    dp, dp0 = carry
    sl = _group_slice(num_groups - 1 - jj, rows)
    x = _lanes(k_ref[sl, :], la_ref[sl, :], om_ref[sl, :], r_ref[sl, :], mu, h, diag)
    reset = reset_ref[sl, :] > 0
    p_prev = pprev_ref[sl, :]
    dgain = dgain_ref[sl, :]
    # Everything off the dp chain, for the whole group at once.
    p_hat = x["a"] * p_prev + x["om"]
    inv_den = 1.0 / (x["r"] + jnp.sum(p_hat * x["kk"], axis=1, keepdims=True))
    gain = p_hat * x["kx"] * inv_den
    dden = -jnp.sum(dgain * gain, axis=1, keepdims=True) * inv_den
    q = dgain * x["kx"] * inv_den + dden * x["kk"]  # dp_hat from the gain
    s = 1.0 / (1.0 + x["u"] * p_hat)
    p_new = p_hat * s
    m = s * s  # d p_new / d p_hat
    dps = jnp.zeros((rows, lanes), F32)  # dp_t of every row (the chain)
    for i in reversed(range(rows)):
      at = slice(i, i + 1)
      dps = jnp.where(row_id == i, dp, dps)
      dprev = x["a"][at] * (m[at] * dp + q[at])
      dp0 = dp0 + jnp.where(reset[at], dprev, 0.0)
      dp = jnp.where(reset[at], 0.0, dprev)
    dp_hat = m * dps + q
    g = dict(
      kx=dgain * p_hat * inv_den,
      kk=dden * p_hat,
      r=dden,
      u=-dps * p_new * p_new,
      a=dp_hat * p_prev,
      om=dp_hat,
    )
    for ref, val in zip((dk_ref, dla_ref, dom_ref, dr_ref, dmu_ref), _raw_grads(x, g, mu, diag)):
      ref[sl, :] = val
    return dp, dp0

  dp, dp0 = lax.fori_loop(0, num_groups, group, (dp_scr[...], dp0_scr[...]))
  dp_scr[...] = dp
  dp0_scr[...] = dp0

  @pl.when(step == pl.num_programs(1) - 1)
  def _():
    dp0_ref[...] = dp0


# ----------------------------------------------------------------------------------------------
# Plans (specs + VMEM blocks) and wrappers. Arrays arrive in kernel.py's layouts, time padded to
# a multiple of the block (`chunk`).


def _forward_plan(bsz, t, nh, kd, diag, block_t, dtypes, save_pprev):
  kdt, ladt, omdt, rdt = dtypes
  lay = _Layout(nh, kd, block_t, t // block_t, diag, reverse=False)
  in_specs = [
    lay.lane("k", kdt),
    lay.lane("log_alpha", ladt),
    lay.omega(omdt),
    lay.heads("r", rdt),
    lay.tokens("reset", jnp.int32),
    lay.state("p0"),
    lay.smem(),
  ]
  lane_shape = (bsz, t, nh * kd) if diag else (bsz * nh, t, 1)
  out_specs = [lay.per_lane("gain", F32)]
  out_shape = [jax.ShapeDtypeStruct(lane_shape, F32)]
  if save_pprev:
    out_specs.append(lay.per_lane("p_prev", F32))
    out_shape.append(jax.ShapeDtypeStruct(lane_shape, F32))
  out_specs.append(lay.state("p_final"))
  out_shape.append(jax.ShapeDtypeStruct((bsz * nh, 1, lay.lanes), F32))
  scratch = [lay.scratch("p")]
  return in_specs, out_specs, out_shape, scratch, lay.blocks


def _backward_plan(bsz, t, nh, kd, diag, block_t, dtypes):
  kdt, ladt, omdt, rdt = dtypes
  lay = _Layout(nh, kd, block_t, t // block_t, diag, reverse=True)
  in_specs = [
    lay.lane("k", kdt),
    lay.lane("log_alpha", ladt),
    lay.omega(omdt),
    lay.heads("r", rdt),
    lay.tokens("reset", jnp.int32),
    lay.smem(),
    lay.per_lane("p_prev", F32),
    lay.per_lane("d_gain", F32),
    lay.state("d_p_final"),
  ]
  lane = jax.ShapeDtypeStruct((bsz, t, nh * kd), F32)
  col = jax.ShapeDtypeStruct((bsz * nh, t, 1), F32)
  out_specs = [
    lay.lane("d_k", F32),
    lay.lane("d_log_alpha", F32),
    lay.lane("d_omega", F32) if diag else lay.column("d_omega", F32),
    lay.column("d_r", F32),
    lay.column("d_mu", F32),
    lay.state("d_p0"),
  ]
  out_shape = [
    lane,
    lane,
    lane if diag else col,
    col,
    col,
    jax.ShapeDtypeStruct((bsz * nh, 1, lay.lanes), F32),
  ]
  scratch = [lay.scratch("d_p"), lay.scratch("d_p0 sum")]
  return in_specs, out_specs, out_shape, scratch, lay.blocks


def forward_blocks(bsz, t, nh, kd, diag, block_t, dtype):
  """The forward's VMEM Blocks (training: with the residual) for inputs of one `dtype`."""
  return _forward_plan(bsz, t, nh, kd, diag, block_t, (dtype,) * 4, True)[4]


def backward_blocks(bsz, t, nh, kd, diag, block_t, dtype):
  return _backward_plan(bsz, t, nh, kd, diag, block_t, (dtype,) * 4)[4]


def _call(kernel, plan, interpret, name, args):
  in_specs, out_specs, out_shape, scratch, _ = plan
  nt = out_shape[0].shape[1] // in_specs[0].block_shape[1]
  grid = (out_shape[-1].shape[0], nt)
  kw = {} if interpret is False or interpret is None else dict(interpret=interpret)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=tuple(out_shape),
    scratch_shapes=scratch,
    name=name,
    compiler_params=tpu_common.compiler_params(("parallel", "arbitrary")),
    **kw,
  )(*args)


def _to_kernel(raw, reset, diag):
  """kernel.py's layouts -> this file's (free reshapes; r and iso omega keep [B, T, H])."""
  k, la, om, r, mu = raw
  bsz, t, nh, kd = k.shape
  flat = lambda x: x.reshape(bsz, t, nh * kd)
  return (
    flat(k),
    flat(la),
    flat(om) if diag else om,
    r,
    reset.astype(jnp.int32).reshape(bsz, t, 1),
  ), mu.astype(F32)


def _lanes_in(x, diag):
  """[B, T, H, L] -> the kernel's per-lane layout."""
  bsz, t, nh, lanes = x.shape
  if diag:
    return x.reshape(bsz, t, nh * lanes)
  return jnp.transpose(x[..., 0], (0, 2, 1)).reshape(bsz * nh, t, 1)


def _lanes_out(x, bsz, nh, diag):
  """The kernel's per-lane layout -> [B, T, H, L]."""
  if diag:
    return x.reshape(bsz, x.shape[1], nh, -1)
  return _columns_out(x, bsz, nh)[..., None]


def _columns_out(x, bsz, nh):
  """[B*H, T, 1] -> [B, T, H]."""
  return jnp.transpose(x.reshape(bsz, nh, -1), (0, 2, 1))


def gain_forward(raw, reset, p0, *, diag, chunk, interpret, cfg, save_pprev=True):
  """As kernel.gain_forward (same arguments and results); `chunk` is the T block."""
  del cfg  # Triton warps/stages: nothing to set on TPU
  k = raw[0]
  bsz, t, nh, kd = k.shape
  tpu_common.check_lane_tile("kdn_gain", "K", kd)
  (kf, laf, omf, r, rs), mu = _to_kernel(raw, reset, diag)
  plan = _forward_plan(bsz, t, nh, kd, diag, chunk, tuple(x.dtype for x in raw[:4]), save_pprev)
  rows = _rows([x.dtype for x in raw[:4]])
  lanes = p0.shape[-1]
  outs = _call(
    functools.partial(_forward_kernel, nh=nh, diag=diag, rows=rows, save_pprev=save_pprev),
    plan,
    interpret,
    "kdn_gain_tpu_fwd",
    (kf, laf, omf, r, rs, p0.astype(F32).reshape(bsz * nh, 1, lanes), mu),
  )
  gain = _lanes_out(outs[0], bsz, nh, diag)
  pprev = _lanes_out(outs[1], bsz, nh, diag) if save_pprev else None
  return gain, pprev, outs[-1].reshape(bsz, nh, lanes)


def gain_backward(raw, reset, pprev, dgain, dpfin, *, diag, chunk, interpret, cfg):
  """As kernel.gain_backward: float32 gradients of the raw inputs (mu's per token [B, T, H])
  and of p0."""
  del cfg
  k = raw[0]
  bsz, t, nh, kd = k.shape
  lanes = pprev.shape[-1]
  (kf, laf, omf, r, rs), mu = _to_kernel(raw, reset, diag)
  plan = _backward_plan(bsz, t, nh, kd, diag, chunk, tuple(x.dtype for x in raw[:4]))
  rows = _rows([x.dtype for x in raw[:4]])
  dk, dla, dom, dr, dmu, dp0 = _call(
    functools.partial(_backward_kernel, nh=nh, diag=diag, rows=rows),
    plan,
    interpret,
    "kdn_gain_tpu_bwd",
    (
      kf,
      laf,
      omf,
      r,
      rs,
      mu,
      _lanes_in(pprev.astype(F32), diag),
      _lanes_in(dgain.astype(F32), diag),
      dpfin.astype(F32).reshape(bsz * nh, 1, lanes),
    ),
  )
  shape4 = (bsz, t, nh, kd)
  dom = dom.reshape(shape4) if diag else _columns_out(dom, bsz, nh)
  d_raw = (
    dk.reshape(shape4),
    dla.reshape(shape4),
    dom,
    _columns_out(dr, bsz, nh),
    _columns_out(dmu, bsz, nh),
  )
  return d_raw, dp0.reshape(bsz, nh, lanes)
