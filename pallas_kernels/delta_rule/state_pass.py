"""Serial state-pass stage (forward): per (batch, head, V block), over chunks in order,
Delta = U - W S_0 (U = A V' and W = A Kbar from wy.py) and S_C = exp(g_last) S_0 + Wt^T Delta,
the chain's only two dots. Saves the chunk-start states and Delta for the output stage
(output.py), or in calls that store no states and have no segments forms O itself
(state_output_forward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
  chunk_output,
  dot,
  dot_tn,
  kernel_precision,
  launch_params,
  operand_dtype,
  state_dtype,
  value_block,
)
from pallas_kernels.kernel_math import exp_for_mode


def _state_pass_kernel(
  *refs,
  chunk,
  num_chunks,
  has_seg,
  block_v,
  prec,
  fuse_output,
  exp,
  g_per_chunk,
):
  """Serial over chunks with U = A V' precomputed (wy.py): Delta = U - W S_0 and
  S <- exp(g_last) S_base + Wt^T Delta, the chain's only two dots.

  Unfused, Delta and the chunk-start states are stored for the output stage (output.py; Delta
  in the dots' operand dtype: it only enters P Delta there). With fuse_output (calls that store
  no states and have no segments) the step also forms the chunk's O = Qbar S_0 + P Delta, off
  the chain: neither Delta nor the states go through memory.

  Chunk c + 1's inputs are loaded before chunk c's dots and carried into the next step: the
  loop is one warp per scheduler with nothing else to issue, and half its stall cycles were
  global-load waits (ncu). The fused output's own rows (Qbar, P) are prefetched likewise. One
  chunk per step: merging several chunks' operands off the chain lost (docs/decisions.md for
  these). `exp`: kernel_math.exp_for_mode of the caller's precision, as in every delta-rule
  kernel.

  g_per_chunk: the "g" input is g_last [B, NC, H, K], the only rows of g the pass reads."""
  if fuse_output and has_seg:
    raise ValueError("state pass: the fused output runs without segments")
  names = ["u", "wk", "wt", "g", "h0"] + (["cont"] if has_seg else [])
  if fuse_output:
    names += ["qbar", "p"]
  r = dict(zip(names, refs[: len(names)]))
  outs = list(refs[len(names) :])
  o_ref = outs.pop(0) if fuse_output else None
  delta_ref = None if fuse_output else outs.pop(0)
  sfin_ref = outs.pop(0)
  states_ref = None if fuse_output else outs.pop(0)
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)

  def inputs(c):
    """Chunk c's loads: U, W, Wt, g_last (cont_last with segments; with fuse_output also the
    rows only the output reads: Qbar and P)."""
    t0 = c * C
    rows = pl.ds(t0, C)
    x = dict(
      u=r["u"][b, rows, h, vs],
      wk=r["wk"][b, rows, h, :],
      wt=r["wt"][b, rows, h, :],
      g_last=r["g"][b, c if g_per_chunk else t0 + C - 1, h, :],
    )
    if has_seg:
      x["cont_last"] = r["cont"][b, t0 + C - 1]
    if fuse_output:
      x.update(qbar=r["qbar"][b, rows, h, :], p=r["p"][b, h, rows, :])
    return x

  def step(c, s, x):
    rows = pl.ds(c * C, C)
    if states_ref is not None:
      states_ref[b, h, c, :, vs] = s.astype(states_ref.dtype)
    delta = x["u"].astype(jnp.float32) - dot(x["wk"], s, prec)

    if fuse_output:
      o = chunk_output(x["qbar"], s, x["p"], delta, prec)
      o_ref[b, rows, h, vs] = o.astype(o_ref.dtype)
    else:
      delta_ref[b, rows, h, vs] = delta.astype(delta_ref.dtype)
    e_last = exp(x["g_last"])[:, None]
    s_base = s
    if has_seg:  # the chunk's last token restarted from S_init inside the chunk
      s_base = x["cont_last"] * s + (1.0 - x["cont_last"]) * s_init
    return e_last * s_base + dot_tn(x["wt"], delta, prec)

  def body(c, carry):
    s, x = carry
    nxt = inputs(jnp.minimum(c + 1, num_chunks - 1))  # (the last step's reload goes unused)
    return step(c, s, x), nxt

  sfin_ref[b, h, :, vs] = lax.fori_loop(0, num_chunks, body, (s_init, inputs(0)))[0]


def state_forward(u, wk, wt, g, h0, cont, *, chunk, interpret, cfg, cfg_prec):
  """The serial stage: (Delta [B, T, H, V] in the dots' operand dtype, S_final [B, H, K, V] f32,
  the chunk-start states [B, H, NC, K, V]). g: [B, T, H, K], or g_last [B, NC, H, K]."""
  return _call(
    u,
    wk,
    wt,
    g,
    h0,
    cont,
    (),
    chunk=chunk,
    interpret=interpret,
    cfg=cfg,
    cfg_prec=cfg_prec,
    out_dtype=None,
  )


def state_output_forward(
  u, wk, wt, g, h0, qbar, pmat, *, chunk, interpret, cfg, cfg_prec, out_dtype
):
  """The serial stage with the output fused (the op's calls that store no states and have no
  segments): (O [B, T, H, V] in out_dtype, S_final [B, H, K, V] f32). qbar: scale q exp(g) (the
  pair kernel's); g: [B, T, H, K], or g_last [B, NC, H, K]."""
  return _call(
    u,
    wk,
    wt,
    g,
    h0,
    None,
    (qbar, pmat),
    chunk=chunk,
    interpret=interpret,
    cfg=cfg,
    cfg_prec=cfg_prec,
    out_dtype=out_dtype,
  )


def _call(u, wk, wt, g, h0, cont, out_in, *, chunk, interpret, cfg, cfg_prec, out_dtype):
  bsz, t, nh, kd = wk.shape
  vd = u.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  fuse_output = bool(out_in)
  g_per_chunk = g.shape[1] != t
  if g_per_chunk and g.shape[1] != nc:
    raise ValueError(
      f"state pass: g has {g.shape[1]} rows; expected T = {t}, or the chunks' {nc} last rows "
      "(g_last)"
    )
  prec = kernel_precision(cfg_prec, interpret)
  block_v = value_block(cfg, kd, vd, parallel=False)
  first = jax.ShapeDtypeStruct(u.shape, out_dtype if fuse_output else operand_dtype(prec))
  out_shape = [first, jax.ShapeDtypeStruct((bsz, nh, kd, vd), jnp.float32)]
  if not fuse_output:  # the chunk-start states, which the output stage reads
    out_shape.append(jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), state_dtype(cfg, prec)))
  return pl.pallas_call(
    functools.partial(
      _state_pass_kernel,
      chunk=chunk,
      num_chunks=nc,
      has_seg=has_seg,
      block_v=block_v,
      prec=prec,
      fuse_output=fuse_output,
      exp=exp_for_mode(cfg_prec),
      g_per_chunk=g_per_chunk,
    ),
    out_shape=tuple(out_shape),
    grid=(bsz, nh, vd // block_v),
    name="delta_rule_state_output" if fuse_output else "delta_rule_state_pass",
    **launch_params(interpret, cfg.num_warps_recur, cfg),
  )(*([u, wk, wt, g, h0] + ([cont] if has_seg else []) + list(out_in)))
