"""The chunked delta rule's forward as one Mosaic-TPU kernel: per-chunk BlockSpec tiles, the
[K, BV] state carried in VMEM scratch over a sequential chunk axis.

Same recurrence as kernel.py (see its docstring for the chunk equations):
    S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T,   o_t = scale S_t^T q_t,
and per chunk of C tokens with chunk-local log-decay cumsum g (restarted at resets), S_0 the
carried state (S_init for rows whose segment starts inside the chunk):
    L_rj = sum_c k_rc w_jc exp(g_rc - g_jc) (r > j, same segment),  A = (I + L)^-1,
    P_rj = scale sum_c q_rc w_jc exp(g_rc - g_jc) (r >= j, same segment),
    Delta = A (V - Kbar S_0),  O = Qbar S_0 + P Delta,  S_C = exp(g_last) S_0 + Wt^T Delta.

Why one kernel here where the GPU path has five (cumsum, intra, recurrent, output, ...): those
take whole arrays and write A, P, Wt, W and every chunk-start state to HBM between stages. On a
TPU the grid runs in order on a core, so
  grid = (B*H, V/BV, T/C), semantics ('parallel', 'parallel', 'arbitrary')
forms everything of a chunk in VMEM from its (C x K) and (C x BV) tiles and only O and the final
state leave the kernel: g by a masked lower-triangular matmul on the MXU, L and P by a loop over
the chunk's columns with decay ratios exp(min(g_r - g_j, 0)) (never exp(-g): no overflow under
strong decay), A by forward substitution in matmuls. The V/BV programs of a head recompute the
K-side work (L, P, A: once per head when BV = V, the default for V <= 128).

Differentiated, it also writes every chunk's start state (the residual of tpu_backward.py, which
recomputes the rest per chunk).

Layouts: q, k, w, log_alpha as [B, T, H*K] (free reshapes), block (C, K) at column block h;
v and o as [B, T, H*V], block (C, BV); initial / final state [B*H, K, V], block (K, BV);
segments as the chunk-local reset count [B, T, 1] float32 (0 while the chunk still continues
the carried state; equal counts = same segment), block (C, 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common, tpu_common

__all__ = ["delta_rule_forward", "forward_blocks", "local_reset_count", "chunk_terms"]

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _dot(x, y, prec, dims=(((1,), (0,)), ((), ()))):
  return lax.dot_general(x, y, dims, precision=prec, preferred_element_type=F32)


def _dot_nt(x, y, prec):  # x @ y^T
  return _dot(x, y, prec, (((1,), (1,)), ((), ())))


def _dot_tn(x, y, prec):  # x^T @ y
  return _dot(x, y, prec, (((0,), (0,)), ((), ())))


def _unit_lower_inverse(lmat):
  """(I + L)^-1 for strictly lower L: A = I - L A solved row by row (row i needs rows < i
  only), each step one C x C matmul, fp32-accurate."""
  c = lmat.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  eye = (row == lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(F32)
  return lax.fori_loop(1, c, lambda i, a: jnp.where(row == i, eye - _dot(lmat, a, HIGHEST), a), eye)


def _pair_products(q, k, w, g, mask_strict, mask_incl, scale):
  """L (strict, masked) and P (inclusive, masked, scaled): column j holds the pair products of
  every row with token j, exp(min(g - g_j, 0)) being exact on the kept rows (g_r <= g_j there)."""
  c = q.shape[0]
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  lmat = jnp.zeros((c, c), F32)
  pmat = lmat
  for j in range(c):  # static: row j of a value is a static sublane slice
    at = slice(j, j + 1)
    we = w[at] * jnp.exp(jnp.minimum(g - g[at], 0.0))
    lmat = jnp.where(col == j, jnp.sum(k * we, axis=1, keepdims=True), lmat)
    pmat = jnp.where(col == j, jnp.sum(q * we, axis=1, keepdims=True), pmat)
  return jnp.where(mask_strict, lmat, 0.0), jnp.where(mask_incl, pmat * scale, 0.0)


def chunk_terms(q, k, w, la, lp, scale):
  """Everything of a chunk that does not touch the state (shared with tpu_backward.py, which
  recomputes it instead of storing A, P and Wt). q, k, w, la: [C, K] f32; lp: [C, 1] f32 resets
  so far in the chunk, or None without segments."""
  c = q.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  strict, incl = row > col, row >= col
  cont = in_last = None
  if lp is not None:
    lp_cols = _dot_nt(jnp.ones_like(lp), lp, HIGHEST)  # [C, C]: (r, j) -> count_j
    same = lp == lp_cols
    strict, incl = strict & same, incl & same
    cont = (lp == 0.0).astype(F32)  # rows still on the carry
    in_last = (lp == lp[c - 1 : c]).astype(F32)  # rows in the last one's segment
  # Chunk-local cumsum restarted at resets, as a 0/1 lower-triangular matmul (fp32-accurate).
  g = _dot(incl.astype(F32), la, HIGHEST)
  lmat, pmat = _pair_products(q, k, w, g, strict, incl, scale)
  e = jnp.exp(g)
  g_last = g[c - 1 : c]
  decay_to_last = jnp.exp(jnp.minimum(g_last - g, 0.0))
  if in_last is not None:
    decay_to_last = decay_to_last * in_last
  e_last = jnp.exp(g_last)
  return dict(
    strict=strict,
    incl=incl,
    cont=cont,
    in_last=in_last,
    g=g,
    pmat=pmat,
    amat=_unit_lower_inverse(lmat),
    e=e,
    kbar=k * e,
    qbar=(scale * q) * e,
    decay_to_last=decay_to_last,
    wt=w * decay_to_last,
    e_last=e_last,
    # exp(g_last) as a [K, 1] column (to scale the state's rows) by an outer product with 1:
    # no lane-to-sublane relayout needed.
    e_col=_dot_tn(e_last, jnp.ones((1, 1), F32), HIGHEST),
  )


def rows_from(x, cont, s0, s_init, prec):
  """x @ S_0 where rows still on the carry read S_0 and the others S_init (cont None: all S_0)."""
  if cont is None:
    return _dot(x, s0, prec)
  return _dot(x * cont, s0, prec) + _dot(x * (1.0 - cont), s_init, prec)


def chunk_base(ct, s0, s_init):
  """The state the chunk's decay applies to: S_init when its last token's segment began in it."""
  if ct["cont"] is None:
    return s0
  cont_last = ct["cont"][-1:]
  return cont_last * s0 + (1.0 - cont_last) * s_init


def _forward_kernel(*refs, scale, has_seg, prec, save_states):
  q_ref, k_ref, w_ref, la_ref, v_ref, h0_ref = refs[:6]
  lp_ref = refs[6] if has_seg else None
  o_ref, sfin_ref = refs[6 + has_seg : 8 + has_seg]
  states_ref = refs[8 + has_seg] if save_states else None
  s_scr = refs[-1]
  c_idx = pl.program_id(2)

  @pl.when(c_idx == 0)
  def _():
    s_scr[...] = h0_ref[...]

  q, k, w, la = (r[...].astype(F32) for r in (q_ref, k_ref, w_ref, la_ref))
  v = v_ref[...].astype(F32)
  ct = chunk_terms(q, k, w, la, lp_ref[...] if has_seg else None, scale)
  s0 = s_scr[...]
  if save_states:
    states_ref[...] = s0
  s_init = h0_ref[...]
  delta = _dot(ct["amat"], v - rows_from(ct["kbar"], ct["cont"], s0, s_init, prec), prec)
  o = rows_from(ct["qbar"], ct["cont"], s0, s_init, prec) + _dot(ct["pmat"], delta, prec)
  o_ref[...] = o.astype(o_ref.dtype)
  s_new = ct["e_col"] * chunk_base(ct, s0, s_init) + _dot_tn(ct["wt"], delta, prec)
  s_scr[...] = s_new

  @pl.when(c_idx == pl.num_programs(2) - 1)
  def _():
    sfin_ref[...] = s_new


def _plan(bsz, t, nh, kd, vd, chunk, block_v, dtypes, out_dtype, has_seg, save_states=False):
  """(in_specs, out_specs, out_shape, scratch, VMEM blocks) of the forward."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  nvb = vd // block_v
  blocks = []

  def spec(name, shape, dtype, index_map):
    blocks.append(tpu_common.Block(name, shape, dtype))
    return pl.BlockSpec((None,) + shape, index_map)

  key = lambda n, dt: spec(n, (chunk, kd), dt, lambda bh, vb, c: (bh // nh, c, bh % nh))
  val = lambda n, dt: spec(
    n, (chunk, block_v), dt, lambda bh, vb, c: (bh // nh, c, (bh % nh) * nvb + vb)
  )
  state = lambda n: spec(n, (kd, block_v), F32, lambda bh, vb, c: (bh, 0, vb))
  qdt, kdt, vdt, wdt, ladt = dtypes
  in_specs = [
    key("q", qdt),
    key("k", kdt),
    key("w", wdt),
    key("log_alpha", ladt),
    val("v", vdt),
    state("S_init"),
  ]
  if has_seg:
    in_specs.append(spec("resets in chunk", (chunk, 1), F32, lambda bh, vb, c: (bh // nh, c, 0)))
  out_specs = [val("o", out_dtype), state("S_final")]
  out_shape = [
    jax.ShapeDtypeStruct((bsz, t, nh * vd), out_dtype),
    jax.ShapeDtypeStruct((bsz * nh, kd, vd), F32),
  ]
  if save_states:  # the backward's residual: every chunk's start state
    blocks.append(tpu_common.Block("chunk-start S", (kd, block_v), F32))
    out_specs.append(pl.BlockSpec((None, None, kd, block_v), lambda bh, vb, c: (bh, c, 0, vb)))
    out_shape.append(jax.ShapeDtypeStruct((bsz * nh, t // chunk, kd, vd), F32))
  blocks.append(tpu_common.Block("S carry", (kd, block_v), F32, pipelined=False))
  return in_specs, out_specs, out_shape, [pltpu.VMEM((kd, block_v), F32)], blocks


# Value columns per forward program: one 128-lane tile (a V split costs only recomputed K-side
# work, and keeps the state scratch at [K, 128]). The backward always takes all of V.
BLOCK_V = 128


def _block_v(vd):
  return min(vd, BLOCK_V)


def forward_blocks(bsz, t, nh, kd, vd, chunk, dtype, has_seg=True, save_states=True):
  """The forward's VMEM Blocks for inputs of one `dtype` (training: saving the states)."""
  return _plan(bsz, t, nh, kd, vd, chunk, _block_v(vd), (dtype,) * 5, dtype, has_seg, save_states)[
    4
  ]


def local_reset_count(pid, chunk):
  """pid [B, T] int (segment number, +1 at every reset) -> [B, T, 1] float32: the resets from
  the token's chunk start up to the token (0: still the carried segment)."""
  bsz, t = pid.shape
  per_chunk = pid.reshape(bsz, t // chunk, chunk)
  before = jnp.concatenate([jnp.zeros_like(per_chunk[:, :1, -1]), per_chunk[:, :-1, -1]], axis=1)
  return (per_chunk - before[..., None]).astype(F32).reshape(bsz, t, 1)


def delta_rule_forward(
  q, k, v, w, la, h0, pid, *, chunk, scale, interpret, prec, out_dtype, save_states=False
):
  """q, k, w, la: [B,T,H,K] (T a multiple of chunk; la per channel); v [B,T,H,V]; h0 [B,H,K,V]
  f32; pid [B,T] int32 or None (no segments); prec: 'fast' | 'exact'.
  Returns (o [B,T,H,V] out_dtype, S_final [B,H,K,V] f32, and with save_states the chunk-start
  states [B*H, T/chunk, K, V] f32 (tpu_backward's residual))."""
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  for name, n in (("K", kd), ("V", vd)):
    tpu_common.check_lane_tile("delta_rule", name, n)
  has_seg = pid is not None
  block_v = _block_v(vd)
  in_specs, out_specs, out_shape, scratch, _ = _plan(
    bsz,
    t,
    nh,
    kd,
    vd,
    chunk,
    block_v,
    tuple(x.dtype for x in (q, k, v, w, la)),
    out_dtype,
    has_seg,
    save_states,
  )
  flat = lambda x: x.reshape(bsz, t, nh * x.shape[-1])
  args = [flat(q), flat(k), flat(w), flat(la), flat(v), h0.reshape(bsz * nh, kd, vd)]
  if has_seg:
    args.append(local_reset_count(pid, chunk))
  kw = {} if interpret is False or interpret is None else dict(interpret=interpret)
  outs = pl.pallas_call(
    functools.partial(
      _forward_kernel,
      scale=scale,
      has_seg=has_seg,
      prec=common.dot_precision(prec, interpret),
      save_states=save_states,
    ),
    grid=(bsz * nh, vd // block_v, t // chunk),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=tuple(out_shape),
    scratch_shapes=scratch,
    name="delta_rule_tpu_fwd",
    compiler_params=tpu_common.compiler_params(("parallel", "parallel", "arbitrary")),
    **kw,
  )(*args)
  o, sfin = outs[0].reshape(bsz, t, nh, vd), outs[1].reshape(bsz, nh, kd, vd)
  return (o, sfin, outs[2]) if save_states else (o, sfin)
