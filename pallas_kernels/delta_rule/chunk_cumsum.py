"""The transpose of the chunk-local log-decay cumsum g, as a Pallas kernel (the backward's).

g_t = sum of log_alpha over t's piece up to t, where pieces restart at every `starts` flag
(chunk starts and segment resets); the token-parallel pair kernel forms g in the forward
(intra.py). Its transpose is the reverse cumsum within pieces, plus the exclusive forward prefix
of the intra backward's direct log-decay terms. One program per (batch, head, block of rows),
the rows summed one after another in fp32: the same sequential sum as a token loop (a masked
matmul would round on GPU tensor cores), and faster than XLA's associative scan over all of T
(docs/decisions.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.token_loop import blocked_loop

_MAX_ROWS = 64  # rows per program: a whole number of chunks


def _rows_per_program(t, chunk, max_rows=_MAX_ROWS):
  rows = chunk
  while rows * 2 <= max_rows and t % (rows * 2) == 0:
    rows *= 2
  return rows


def _reverse_kernel(dg_ref, terms_ref, starts_ref, out_ref, *, rows, block):
  """out = reverse cumsum of dg within pieces + exclusive forward prefix of terms within pieces.
  The prefix is written first and read back by the reverse loop: the same program's own stores,
  each [1, K] row in the same layout. With K >= 32 (one warp) every lane reads back only what it
  stored; narrower rows are replicated across lanes, so a lane may read another lane's store of
  the same warp (the same value it stored itself), after it in program order: the reverse loop's
  first block of loads follows the forward loop's last stores directly (GPU-checked at K = 128
  and K = 16)."""
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = i * rows
  zeros = jnp.zeros((1, dg_ref.shape[-1]), jnp.float32)

  def forward_load(j):
    t = t0 + j
    return terms_ref[b, pl.ds(t, 1), h, :], starts_ref[b, pl.ds(t, 1)]

  def forward(j, xs, acc):
    term, start = xs
    acc = jnp.where(start[:, None] > 0, 0.0, acc)
    out_ref[b, pl.ds(t0 + j, 1), h, :] = acc
    return acc + term

  # (the reverse loop reads row t's prefix before it rewrites row t; blocks read ahead only
  # rows it has not reached yet)
  def reverse_load(j):
    t = t0 + rows - 1 - j
    return dg_ref[b, pl.ds(t, 1), h, :], out_ref[b, pl.ds(t, 1), h, :], starts_ref[b, pl.ds(t, 1)]

  def reverse(j, xs, acc):
    dg, prefix, start = xs
    acc = acc + dg
    out_ref[b, pl.ds(t0 + rows - 1 - j, 1), h, :] = acc + prefix
    return jnp.where(start[:, None] > 0, 0.0, acc)  # t starts its piece

  blocked_loop(rows, block, forward_load, forward, zeros)
  blocked_loop(rows, block, reverse_load, reverse, zeros)


def _call(kernel, name, args, starts, chunk, interpret, num_warps, block):
  bsz, t, nh, kd = args[0].shape
  if t % chunk:
    raise ValueError(f"{name}: time length {t} is not a multiple of chunk={chunk}")
  rows = _rows_per_program(t, chunk)
  return pl.pallas_call(
    functools.partial(kernel, rows=rows, block=block),
    out_shape=jax.ShapeDtypeStruct((bsz, t, nh, kd), jnp.float32),
    grid=(bsz, nh, t // rows),
    name=name,
    interpret=interpret,
    compiler_params=common.compiler_params(num_warps, 1),
  )(*args, starts.astype(jnp.int32))


def chunk_reverse_cumsum(dg, terms, starts, *, chunk, interpret, block, num_warps=1):
  """The transpose of the chunk-local cumsum applied to dg, plus the exclusive prefix sum of
  `terms` within pieces (at t: the sum over the piece's s < t, in token order as a token loop
  sums it); all [B,T,H,K] float32 (T a multiple of chunk); starts [B,T] bool, True at every chunk
  start (the program blocks end on chunk boundaries) and reset. block: rows whose loads are
  issued together (blocked_loop; the callers pass DeltaRuleConfig.cumsum_block)."""
  return _call(
    _reverse_kernel,
    "delta_rule_reverse_cumsum",
    (dg.astype(jnp.float32), terms.astype(jnp.float32)),
    starts,
    chunk,
    interpret,
    num_warps,
    block,
  )
