"""Output stage (forward, parallel over chunks and V blocks):
O = Qbar S_0 (S_init for rows whose segment starts inside the chunk) + P Delta,
from the pair kernel's Qbar, the saved chunk-start states and the serial pass's Delta.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
  by_reset,
  chunk_output,
  kernel_precision,
  launch_params,
  value_block,
)


def _output_kernel(*refs, chunk, has_seg, block_v, prec):
  """Parallel over (chunk, V block): O from the saved chunk-start state and Delta. Grid
  (V/BV, NC, B H): the V blocks of one chunk, then the chunks of one (batch, head), run next to
  each other and share its Qbar and P tiles in L2."""
  names = ["qbar", "p", "delta", "states", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[: len(names)]))
  o_ref = refs[len(names)]
  vb, c, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nh = r["qbar"].shape[2]
  b, h = bh // nh, bh % nh
  C = chunk
  t0 = c * C
  vs = pl.ds(vb * block_v, block_v)
  by_reset(
    r.get("cont"),
    b,
    t0 + C - 1,
    lambda seg: _output_rows(r, o_ref, b, h, c, t0, C, vs, seg, prec),
  )


def _output_rows(r, o_ref, b, h, c, t0, C, vs, seg, prec):
  """One chunk's O rows for one V block; seg: the chunk holds a reset."""
  rows = pl.ds(t0, C)
  s = r["states"][b, h, c, :, vs].astype(jnp.float32)
  seg_kw = (
    dict(cont=r["cont"][b, rows][:, None], s_init=r["h0"][b, h, :, vs].astype(jnp.float32))
    if seg
    else {}
  )
  o = chunk_output(
    r["qbar"][b, rows, h, :], s, r["p"][b, h, rows, :], r["delta"][b, rows, h, vs], prec, **seg_kw
  )
  o_ref[b, rows, h, vs] = o.astype(o_ref.dtype)


def output_forward(
  qbar, pmat, delta, states, h0, cont, *, chunk, interpret, cfg, cfg_prec, out_dtype
):
  """O [B, T, H, V] in out_dtype from Qbar = scale q exp(g) (the pair kernel's), P, Delta
  [B, T, H, V] and the chunk-start states."""
  bsz, t, nh, _ = qbar.shape
  vd = delta.shape[-1]
  has_seg = cont is not None
  prec = kernel_precision(cfg_prec, interpret)
  bv_par = value_block(cfg, qbar.shape[-1], vd, parallel=True)
  out_in = [qbar, pmat, delta, states, h0] + ([cont] if has_seg else [])
  grid = (vd // bv_par, t // chunk, bsz * nh)
  return pl.pallas_call(
    functools.partial(
      _output_kernel,
      chunk=chunk,
      has_seg=has_seg,
      block_v=bv_par,
      prec=prec,
    ),
    out_shape=jax.ShapeDtypeStruct((bsz, t, nh, vd), out_dtype),
    grid=grid,
    name="delta_rule_output",
    **launch_params(interpret, cfg.num_warps_output, cfg),
  )(*out_in)
