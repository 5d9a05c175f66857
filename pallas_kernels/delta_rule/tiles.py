"""Helpers the delta-rule stage kernels share: dots at the kernels' precision, tile loads,
storage dtypes and launch parameters. No kernels here, and no imports of the stage modules."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

_NT = (((1,), (1,)), ((), ()))  # x @ y^T
_TN = (((0,), (0,)), ((), ()))  # x^T @ y


BF16_OPERANDS = "bf16_operands"  # a `prec` value: round both operands to bf16, accumulate in fp32


def dims(x, y, dims, prec):
  if prec == BF16_OPERANDS:
    x, y, prec = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), lax.Precision.DEFAULT
  return lax.dot_general(x, y, dims, precision=prec, preferred_element_type=jnp.float32)


def dot(x, y, prec):
  return dims(x, y, (((1,), (0,)), ((), ())), prec)


def dot_nt(x, y, prec):
  return dims(x, y, _NT, prec)


def dot_tn(x, y, prec):
  return dims(x, y, _TN, prec)


def iota(c, axis):
  return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def tile(ref, b, t0, c, h, f32=True):
  x = ref[b, pl.ds(t0, c), h, :]
  return x.astype(jnp.float32) if f32 else x


def write_parts(w_ref, k_ref, b, t, h, ks=slice(None)):
  """The write direction at (b, t, h) (t and h an index or a pl.ds) as (rows, beta), fp32, on
  the key columns ks: (w_ref's rows, None) for a [B, T, H, K] write; for a per-token scalar
  write ([B, T, H]: write = beta k), (k's rows, beta), so that no [B, T, H, K] write array goes
  through memory and a kernel can apply beta after reducing over K (one multiply per row, not
  per element)."""
  if len(w_ref.shape) == 4:
    return w_ref[b, t, h, ks].astype(jnp.float32), None
  return k_ref[b, t, h, ks].astype(jnp.float32), w_ref[b, t, h].astype(jnp.float32)


def write_rows(w_ref, k_ref, b, t, h, ks=slice(None)):
  """The write direction's rows at (b, t, h), fp32 (write_parts with beta applied)."""
  rows, beta = write_parts(w_ref, k_ref, b, t, h, ks)
  return rows if beta is None else beta[..., None] * rows


def key_tiles(kd, cfg):
  """The key-column slices the intra-chunk kernels (pair, WY, intra backward) loop over: all of
  K (slice(None), the program a K <= block_k kernel always ran) or tiles of cfg.block_k."""
  if kd <= cfg.block_k:
    return [slice(None)]
  return [pl.ds(i * cfg.block_k, cfg.block_k) for i in range(kd // cfg.block_k)]


def value_block(cfg, kd, vd, parallel):
  """The value columns one program of the recurrent (parallel=False) or parallel kernels holds
  at key width kd: block_v / block_v_parallel, or their wide_ fields when K > block_k."""
  if kd > cfg.block_k:
    bv = cfg.wide_block_v_parallel if parallel else cfg.wide_block_v
  else:
    bv = cfg.block_v_parallel if parallel else cfg.block_v
  return min(bv, vd)


def times_beta(x, beta):
  """x (values reduced over K) times beta (write_parts' second value); x when there is none."""
  return x if beta is None else x * beta


def by_reset(cont_ref, b, t_last, body):
  """body(seg) for the chunk ending at token t_last: without segments (cont_ref None) the
  segment-free body; with them, the segment body (seg=True) only where the chunk holds a reset
  (cont is 1 until the chunk's first reset, so its last row is 0 exactly when there is one, at
  any row, the first included), the segment-free body elsewhere. In a chunk without a reset
  every row continues the chunk-start state and shares one segment, so both bodies give the
  same values there (up to fp32 rounding: the segment body's blends by cont, e.g. of S and
  S_init, may round or contract differently); the segment body's S_init tile and masks cost
  registers and dots, which most chunks then skip. Used by the WY, output and backward-partials
  kernels, where it paid with packed documents; the pair kernel, whose segment masks are cheap,
  did not gain and keeps one body (docs/decisions.md, `tiles.by_reset`)."""
  if cont_ref is None:
    body(False)
    return
  reset = cont_ref[b, t_last] < 0.5
  pl.when(reset)(lambda: body(True))
  pl.when(jnp.logical_not(reset))(lambda: body(False))


def chunk_output(qbar, s, p, delta, prec, cont=None, s_init=None):
  """One chunk's output rows O = Qbar S_0 + P Delta (Qbar = scale q exp(g), the pair kernel's);
  with cont (the rows' [C, 1] continuation flags) the rows
  after the chunk's first reset read S_init instead of S_0. Shared by the output kernel and the
  state pass with the output fused."""
  qbar = qbar.astype(jnp.float32)
  if cont is None:
    o = dot(qbar, s, prec)
  else:
    o = dot(qbar * cont, s, prec) + dot(qbar * (1.0 - cont), s_init, prec)
  return o + dot(p, delta, prec)


def kernel_precision(cfg_prec, interpret):
  """The kernels' dot precision: 'fast' means bf16 operands with fp32 accumulation (twice the
  TF32 tensor-core rate; docs/decisions.md), 'exact' fp32-accurate dots."""
  if cfg_prec == "fast":
    return BF16_OPERANDS
  return common.dot_precision(cfg_prec, interpret)


def operand_dtype(prec):
  """Storage dtype of arrays that are only dot operands: bf16 when the dots round to bf16."""
  return jnp.bfloat16 if prec == BF16_OPERANDS else jnp.float32


def state_dtype(cfg, prec):
  """Storage of the saved chunk-start states and state gradients: bf16 with cfg.bf16_states under
  bf16-operand dots (their dots round to bf16 anyway; the elementwise uses see the rounding: the
  g_last decay gradient and, with segments, seg_init_grad's chunk-end term), else fp32."""
  return jnp.bfloat16 if cfg.bf16_states and prec == BF16_OPERANDS else jnp.float32


def launch_params(interpret, num_warps, cfg):
  return dict(
    interpret=interpret, compiler_params=common.compiler_params(num_warps, cfg.num_stages)
  )
