"""The delta rule's forward: its stages (intra + WY, the serial state pass, the output) on
stage_inputs' arrays, per (batch, head) shard; the Mosaic-TPU forward where those kernels run."""

from __future__ import annotations

import functools

from pallas_kernels import sharding, tpu_common
from pallas_kernels.delta_rule import intra as _intra
from pallas_kernels.delta_rule import output as _output
from pallas_kernels.delta_rule import stages as _stages
from pallas_kernels.delta_rule import state_pass as _state_pass
from pallas_kernels.delta_rule import tpu_forward as _tpu_forward

# (batch, head) dims of the kernels' arrays for sharding.per_shard, and (batch, head, ndim) of
# their results.
BTHK = (0, 2)  # [B, T, H, K or V]
BH = (0, 1)  # [B, H, ...]: states, A, P
BT = (0, None)  # [B, T]: segment bookkeeping
IN = (BTHK,) * 5 + (BH, BT, BT, BT)  # q, k, v, w, la, h0, starts, cont, pid
RES = (BTHK, BH, BH, BTHK, BTHK, BH)  # g, A, P, Wt, W, chunk-start states
OUT4, STATE4, STATES5 = BTHK + (4,), BH + (4,), BH + (5,)
RES_OUT = (OUT4, STATE4, STATE4, OUT4, OUT4, STATES5)  # results: g, A, P, Wt, W, states


def forward_stages(
  q,
  k,
  v,
  w,
  la,
  h0,
  starts,
  cont,
  pid,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  prec,
  save,
  run=_stages.call,
):
  """The forward's stages on stage_inputs' arrays: (o, S_final) or, with `save`, (o, S_final, g,
  A, P, Wt, W, chunk-start states), the residuals backward_stages reads. run: the stage runner
  (stages.py).

  q, k: [B,T,H,K]; w: [B,T,H,K] or [B,T,H] (write = w k); v: [B,T,H,V]; la: log_alpha
  [B,T,H,K] (the pair kernel forms the chunk-local cumsum g); h0 [B,H,K,V] f32; cont: [B,T] f32
  or None; pid: [B,T] int32 or None (both None without segments)."""
  del starts  # (the pair kernel restarts g at chunk starts and at the segment ids' changes)
  kw = dict(chunk=chunk, interpret=interpret, cfg=cfg, cfg_prec=prec)
  x = _intra.intra_forward(q, k, v, w, la, h0, pid, cont, scale=scale, keep_g=save, run=run, **kw)
  # O formed in the serial pass, off its chain (Delta never through memory), in calls that store
  # no states and have no segments; elsewhere it lost (docs/decisions.md). Without `save` the
  # pair kernel wrote only g's chunk-last rows, all the state pass reads.
  if not save and cont is None:
    o, sfin = run(
      "state_output",
      _state_pass.state_output_forward,
      x.u,
      x.wk,
      x.wt,
      x.g_last,
      h0,
      x.qbar,
      x.pmat,
      out_dtype=q.dtype,
      **kw,
    )
    return o, sfin
  g_chain = x.g if save else x.g_last
  delta, sfin, states = run(
    "state", _state_pass.state_forward, x.u, x.wk, x.wt, g_chain, h0, cont, **kw
  )
  o = run(
    "output",
    _output.output_forward,
    x.qbar,
    x.pmat,
    delta,
    states,
    h0,
    cont,
    out_dtype=q.dtype,
    **kw,
  )
  if not save:
    return o, sfin
  return (o, sfin, x.g, x.amat, x.pmat, x.wt, x.wk, states)


def forward(save, args, chunk, scale, interpret, cfg, prec):
  """forward_stages per (batch, head) shard on stage_inputs' arrays `args`, or the Mosaic-TPU
  forward where those kernels run: (o, S_final) and, with `save`, the residuals."""
  if tpu_common.use_tpu_kernels(interpret):
    # TPU: one BlockSpec kernel (tpu_forward.py); with `save` it also returns the chunk-start
    # states, the residual of tpu_backward.py.
    q, k, v, w, la, h0, _, _, pid = args
    return _tpu_forward.delta_rule_forward(
      q,
      k,
      v,
      w,
      la,
      h0,
      pid,
      chunk=chunk,
      scale=scale,
      interpret=interpret,
      prec=prec,
      out_dtype=q.dtype,
      save_states=save,
    )
  body = functools.partial(
    forward_stages, chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, prec=prec, save=save
  )
  outs = (OUT4, STATE4) + (RES_OUT if save else ())
  return sharding.per_shard(body, IN, outs, "delta_rule forward")(*args)
