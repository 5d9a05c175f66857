"""The delta rule's backward: the reverse stages (the dS chain, the partial gradients, the intra
backward, the reverse cumsum of g's gradient) per (batch, head) shard; the Mosaic-TPU backward
where those kernels run."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels import sharding
from pallas_kernels.delta_rule import backward as _backward
from pallas_kernels.delta_rule import chunk_cumsum as _cumsum_kernels
from pallas_kernels.delta_rule import stages as _stages
from pallas_kernels.delta_rule import tpu_backward as _tpu_backward
from pallas_kernels.delta_rule.chunk_fwd import BH, BTHK, IN, OUT4, RES, STATE4


def backward_stages(
  q,
  k,
  v,
  w,
  g,
  h0,
  starts,
  cont,
  pid,
  amat,
  pmat,
  wt,
  wk,
  states,
  do,
  dsfin,
  dext=None,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  prec,
  run=_stages.call,
):
  """The backward's stages: (dq, dk, dv, dw, dlog_alpha, dh0) from stage_inputs' arrays,
  forward_stages' residuals (g, A, P, Wt, W, states) and the cotangents of o and S_final (dext:
  of the chunk-start states, or None). run: the stage runner (stages.py)."""
  dq, dk, dv, dw, dg, dla_terms, dh0 = _backward.backward(
    q,
    k,
    v,
    w,
    g,
    h0,
    cont,
    pid,
    (amat, pmat, wt, wk, states),
    do,
    dsfin,
    dext,
    chunk=chunk,
    scale=scale,
    interpret=interpret,
    cfg=cfg,
    cfg_prec=prec,
    grad_dtypes=(q.dtype, k.dtype, v.dtype),
    run=run,
  )
  # g = within-(chunk, segment) cumsum of log_alpha  =>  dla = reverse cumsum of dg, plus the
  # direct term: the exclusive prefix of dla_terms. (Its pieces restart at resets too, which
  # changes nothing: a term is zero outside its chunk's last segment, where every later token
  # of the chunk lies.)
  dla = run(
    "reverse_cumsum",
    _cumsum_kernels.chunk_reverse_cumsum,
    dg,
    dla_terms,
    starts,
    chunk=chunk,
    interpret=interpret,
    block=cfg.cumsum_block,
  )
  return dq, dk, dv, dw, dla, dh0


def backward(saved, do, dsfin, dext, chunk, scale, interpret, cfg, prec):
  """(dq, dk, dv, dw, dlog_alpha, dh0), each in its input's dtype (dh0 fp32), from the forward's
  saved arrays (chunk.py, _core_fwd) and the cotangents of o, S_final and (dext, or None) the
  chunk-start states."""
  q, k, v, w, h0, starts, cont, pid, res, la_like = saved
  body = functools.partial(
    backward_stages, chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, prec=prec
  )
  dims = IN[:4] + (BTHK,) + IN[5:] + RES[1:] + (BTHK, BH, BH)
  outs = (OUT4,) * 3 + (BTHK + (w.ndim,), OUT4, STATE4)
  dq, dk, dv, dw, dla, dh0 = sharding.per_shard(body, dims, outs, "delta_rule backward")(
    q, k, v, w, *res[:1], h0, starts, cont, pid, *res[1:], do, dsfin.astype(jnp.float32), dext
  )
  grads = (dq, dk, dv, dw, dla)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, w, la_like))) + (dh0,)


def tpu_backward(saved, cts, chunk, scale, interpret, prec):
  """As backward, on the Mosaic-TPU kernels (tpu_backward.py), from their forward's saved
  arrays (q, k, v, w, la, h0, pid, chunk-start states)."""
  q, k, v, w, la, h0, pid, states = saved
  grads = _tpu_backward.delta_rule_backward(
    q,
    k,
    v,
    w,
    la,
    h0,
    pid,
    states,
    *cts,
    chunk=chunk,
    scale=scale,
    interpret=interpret,
    prec=prec,
  )
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, w, la))) + (grads[5],)
