"""Output stage (forward, parallel over chunks and V blocks):
O = Qbar S_0 (S_init for rows whose segment starts inside the chunk) + P Delta,
from the saved chunk-start states and the serial pass's Delta. With a state stride m > 1 (calls
that are not differentiated) one program takes m consecutive chunks from one saved state and
steps S_0 between them as the serial pass does (S <- exp(g_last) S + Wt^T Delta): m times fewer
[K, V] states written and read.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
    dot, dot_tn, tile, kernel_precision, launch_params, by_reset)


def _output_kernel(*refs, chunk, scale, has_seg, block_v, prec, stride, num_chunks):
  """Parallel over (chunk, V block): O from the saved chunk-start state and Delta. Grid
  (V/BV, NC / stride, B H): the V blocks of one chunk, then the chunks of one (batch, head), run
  next to each other and share its q, g and P tiles in L2."""
  names = ["q", "g", "p", "delta", "states", "h0"] + (["wt"] if stride > 1 else []) + (
      ["cont"] if has_seg else [])
  r = dict(zip(names, refs[:len(names)]))
  o_ref = refs[len(names)]
  vb, blk, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nh = r["q"].shape[2]
  b, h = bh // nh, bh % nh
  C = chunk
  vs = pl.ds(vb * block_v, block_v)
  s0 = r["states"][b, h, blk, :, vs].astype(jnp.float32)

  def rows(c, s):
    t0 = c * C
    by_reset(r.get("cont"), b, t0 + C - 1, lambda seg: _output_rows(
        r, o_ref, s, b, h, t0, C, vs, scale, seg, prec))

  if stride == 1:
    rows(blk, s0)
    return

  def step(j, s):
    c = blk * stride + j
    rows(c, s)
    return _next_state(r, s, b, h, c * C, C, vs, prec)

  lax.fori_loop(0, jnp.minimum(stride, num_chunks - blk * stride), step, s0)


def _output_rows(r, o_ref, s, b, h, t0, C, vs, scale, seg, prec):
  """One chunk's O rows for one V block from its start state s; seg: the chunk holds a reset."""
  qbar = (scale * tile(r["q"], b, t0, C, h)) * jnp.exp(tile(r["g"], b, t0, C, h))
  if seg:   # rows whose segment starts inside the chunk read S_init
    cont = r["cont"][b, pl.ds(t0, C)][:, None]
    o = dot(qbar * cont, s, prec) + dot(qbar * (1.0 - cont),
                                        r["h0"][b, h, :, vs].astype(jnp.float32), prec)
  else:
    o = dot(qbar, s, prec)
  o = o + dot(r["p"][b, h, pl.ds(t0, C), :], r["delta"][b, pl.ds(t0, C), h, vs], prec)
  o_ref[b, pl.ds(t0, C), h, vs] = o.astype(o_ref.dtype)


def _next_state(r, s, b, h, t0, C, vs, prec):
  """The next chunk's start state, as the serial pass forms it (state_pass.py)."""
  e_last = jnp.exp(r["g"][b, t0 + C - 1, h, :].astype(jnp.float32))[:, None]
  if "cont" in r:   # the chunk's last token restarted from S_init inside the chunk
    cont_last = r["cont"][b, t0 + C - 1]
    s = cont_last * s + (1.0 - cont_last) * r["h0"][b, h, :, vs].astype(jnp.float32)
  return e_last * s + dot_tn(r["wt"][b, pl.ds(t0, C), h, :], r["delta"][b, pl.ds(t0, C), h, vs],
                             prec)


def output_forward(q, g, pmat, delta, states, h0, cont, *, chunk, scale, interpret, cfg, cfg_prec,
                   wt=None, stride=1):
  """O [B, T, H, V] in q's dtype from Delta [B, T, H, V] and the chunk-start states (of every
  stride-th chunk: state_pass.state_forward; then Wt steps the others)."""
  bsz, t, nh, _ = q.shape
  vd = delta.shape[-1]
  has_seg = cont is not None
  prec = kernel_precision(cfg, cfg_prec, interpret)
  bv_par = min(cfg.block_v_parallel, vd)
  nc = t // chunk
  out_in = [q, g, pmat, delta, states, h0] + ([wt] if stride > 1 else []) + (
      [cont] if has_seg else [])
  grid = (vd // bv_par, -(-nc // stride), bsz * nh)
  return pl.pallas_call(
      functools.partial(_output_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                        block_v=bv_par, prec=prec, stride=stride, num_chunks=nc),
      out_shape=jax.ShapeDtypeStruct((bsz, t, nh, vd), q.dtype),
      grid=grid, name="delta_rule_output",
      **launch_params(interpret, cfg.num_warps_output, cfg),
  )(*out_in)
