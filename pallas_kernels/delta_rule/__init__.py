"""Chunked asymmetric delta rule (per-channel or scalar decay) as Pallas kernels + custom VJP.

Per (batch, head) and chunk of C tokens with chunk-local log-decay cumsum g (restarted at segment
starts), state S_0 at the chunk start (S_init for rows whose segment starts inside the chunk):
    L_rj = sum_c k_rc w_jc exp(g_rc - g_jc)   (r > j, same segment)        A = (I + L)^-1
    P_rj = scale sum_c q_rc w_jc exp(g_rc - g_jc)   (r >= j, same segment)
    Kbar = k * exp(g), Qbar = scale q * exp(g), Wt_j = w_j exp(g_last - g_j) (same segment as last)
    U = V - Kbar S_0,  Delta = A U,  O = Qbar S_0 + P Delta,  S_C = exp(g_last) S_0 + Wt^T Delta.
Decay ratios are only ever formed as exp(min(g_r - g_j, 0)) of log DIFFERENCES, never exp(-g).

One module per stage (options in config.DeltaRuleConfig), imported only from here:
  intra         g, L, P, Wt, Kbar and Qbar (the token-parallel pair kernel, from log_alpha; the
                later stages read Kbar and Qbar in place of k, q and g), then wy: A,
                W = A Kbar, U = A V', parallel over chunks
  state_pass    the serial chunk loop: S_final, chunk-start states, Delta = U - W S_0 (with
                calls that store no states and have no segments also O, in the same loop)
  output        O = Qbar S_0 + P Delta, parallel over chunks
  backward      the reverse dS chain, dV and the partial gradients, then intra_bwd_tokens
  intra_bwd_tokens  the intra backward, token-parallel
  chunk_cumsum  the transpose of g's chunk-local cumsum (the backward's)
  tiles         helpers the stage kernels share (no kernels)
  tpu_forward / tpu_backward   the Mosaic-TPU kernels (BlockSpec tiles; docs/tpu.md)
The Triton kernels run chunks of config.GPU_CHUNK (16) tokens; the TPU kernels any power of two
up to DeltaRuleConfig.max_chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common, tpu_common, tuned
from pallas_kernels import sharding as _sharding
from pallas_kernels.delta_rule import backward as _backward
from pallas_kernels.delta_rule import chunk_cumsum as _cumsum_kernels
from pallas_kernels.delta_rule import intra as _intra
from pallas_kernels.delta_rule import output as _output
from pallas_kernels.delta_rule import stages as _stages
from pallas_kernels.delta_rule import state_pass as _state_pass
from pallas_kernels.delta_rule import tiles as _tiles
from pallas_kernels.delta_rule import tpu_backward as _tpu_backward
from pallas_kernels.delta_rule import tpu_forward as _tpu_forward
from pallas_kernels.delta_rule.config import GPU_CHUNK

__all__ = [
  "delta_rule",
  "stage_inputs",
  "forward_stages",
  "backward_stages",
  "chunk_length",
  "segment_arrays",
  "write_dtype",
]


# (batch, head) dims of the kernels' arrays for sharding.per_shard, and (batch, head, ndim) of
# their results.
_BTHK = (0, 2)  # [B, T, H, K or V]
_BH = (0, 1)  # [B, H, ...]: states, A, P
_BT = (0, None)  # [B, T]: segment bookkeeping
_IN = (_BTHK,) * 5 + (_BH, _BT, _BT, _BT)  # q, k, v, w, la, h0, starts, cont, pid
_RES = (_BTHK, _BH, _BH, _BTHK, _BTHK, _BH)  # g, A, P, Wt, W, chunk-start states
_OUT4, _STATE4, _STATES5 = _BTHK + (4,), _BH + (4,), _BH + (5,)


_RES_OUT = (_OUT4, _STATE4, _STATE4, _OUT4, _OUT4, _STATES5)  # results: g, A, P, Wt, W, states


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


def _forward(save, args, chunk, scale, interpret, cfg, prec):
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
  outs = (_OUT4, _STATE4) + (_RES_OUT if save else ())
  return _sharding.per_shard(body, _IN, outs, "delta_rule forward")(*args)


# A call that is not differentiated runs the primal, _core, which saves nothing; a
# differentiated one runs _core_fwd, whose residuals the backward reads.
@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(9, 14)))
def _core(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  return _forward(
    False, (q, k, v, w, la, h0, starts, cont, pid), chunk, scale, interpret, cfg, prec
  )


def _core_fwd(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  if tpu_common.use_tpu_kernels(interpret):
    o, sfin, states = _forward(
      True, (q, k, v, w, la, h0, starts, cont, pid), chunk, scale, interpret, cfg, prec
    )
    return (o, sfin), (q, k, v, w, la, h0, pid, states)
  o, sfin, *res = _forward(
    True, (q, k, v, w, la, h0, starts, cont, pid), chunk, scale, interpret, cfg, prec
  )
  # (an empty array carries log_alpha's dtype: residuals must be arrays)
  return (o, sfin), (q, k, v, w, h0, starts, cont, pid, res, jnp.zeros((0,), la.dtype))


def _core_bwd(chunk, scale, interpret, cfg, prec, saved, cts):
  if tpu_common.use_tpu_kernels(interpret):
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
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, w, la))) + (
      grads[5],
      None,
      None,
      None,
    )
  q, k, v, w, h0, starts, cont, pid, res, la_like = saved
  do, dsfin = cts
  body = functools.partial(
    backward_stages, chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, prec=prec
  )
  dims = _IN[:4] + (_BTHK,) + _IN[5:] + _RES[1:] + (_BTHK, _BH)
  outs = (_OUT4,) * 3 + (_BTHK + (w.ndim,), _OUT4, _STATE4)
  dq, dk, dv, dw, dla, dh0 = _sharding.per_shard(body, dims, outs, "delta_rule backward")(
    q, k, v, w, *res[:1], h0, starts, cont, pid, *res[1:], do, dsfin.astype(jnp.float32)
  )
  return (
    dq.astype(q.dtype),
    dk.astype(k.dtype),
    dv.astype(v.dtype),
    dw.astype(w.dtype),
    dla.astype(la_like.dtype),
    dh0,
    None,
    None,
    None,
  )


_core.defvjp(_core_fwd, _core_bwd)


# The forward of (cfg, chunk) with the chunk-start states as a third output (output_chunk_states):
# the states the backward saves anyway, so no extra pass; their cotangent enters the reverse dS
# chain (backward.state_grads' dext). GPU/interpret kernels only (delta_rule checks).
@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(9, 14)))
def _core_states(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  return _core_states_fwd(
    q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec
  )[0]


def _core_states_fwd(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  (o, sfin), res = _core_fwd(
    q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec
  )
  return (o, sfin, res[8][-1].astype(jnp.float32)), res


def _core_states_bwd(chunk, scale, interpret, cfg, prec, saved, cts):
  q, k, v, w, h0, starts, cont, pid, res, la_like = saved
  do, dsfin, dstates = cts
  dstates = dstates.astype(jnp.float32)
  # dext[c]: the cotangent of the state after chunk c, the start state of chunk c + 1 (the last
  # chunk's is S_final's, dsfin); chunk 0's start state is h0, whose gradient it joins directly.
  dext = jnp.concatenate([dstates[:, :, 1:], jnp.zeros_like(dstates[:, :, :1])], axis=2)
  body = functools.partial(
    backward_stages, chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, prec=prec
  )
  dims = _IN[:4] + (_BTHK,) + _IN[5:] + _RES[1:] + (_BTHK, _BH, _BH)
  outs = (_OUT4,) * 3 + (_BTHK + (w.ndim,), _OUT4, _STATE4)
  dq, dk, dv, dw, dla, dh0 = _sharding.per_shard(body, dims, outs, "delta_rule backward")(
    q, k, v, w, *res[:1], h0, starts, cont, pid, *res[1:], do, dsfin.astype(jnp.float32), dext
  )
  return (
    dq.astype(q.dtype),
    dk.astype(k.dtype),
    dv.astype(v.dtype),
    dw.astype(w.dtype),
    dla.astype(la_like.dtype),
    dh0 + dstates[:, :, 0],
    None,
    None,
    None,
  )


_core_states.defvjp(_core_states_fwd, _core_states_bwd)


def chunk_length(cfg, chunk_size, t, interpret):
  """The kernels' chunk C for a caller's chunk_size and length t: GPU_CHUNK on the Triton kernels
  (a config with another max_chunk is refused there); on the TPU kernels chunk_size capped by
  cfg.max_chunk and by t (rounded up to a power of two), at least 16."""
  if not tpu_common.use_tpu_kernels(interpret):
    if cfg.max_chunk != GPU_CHUNK:
      raise ValueError(
        f"DeltaRuleConfig.max_chunk={cfg.max_chunk}: the Triton kernels run chunks of "
        f"{GPU_CHUNK} (longer ones lost on the GPU: docs/decisions.md); max_chunk sets the TPU "
        "kernels' chunk"
      )
    return GPU_CHUNK
  return max(16, min(chunk_size, cfg.max_chunk, common.next_pow2(t)))


def segment_arrays(segment_ids, bsz, t, t_pad, chunk):
  """The kernels' segment bookkeeping for time padded to t_pad: (starts [B, t_pad] bool: where
  the log-decay cumsum restarts (chunk starts and resets), cont [B, t_pad] f32: 1 while no reset
  has happened yet in the token's chunk, pid [B, t_pad] int32: segment number); cont and pid are
  None without segment_ids."""
  chunk_start = (jnp.arange(t_pad) % chunk == 0)[None, :]
  if segment_ids is None:
    return jnp.broadcast_to(chunk_start, (bsz, t_pad)), None, None
  reset = common.reset_flags(segment_ids, bsz, t, t_pad)
  pid = jnp.cumsum(reset.astype(jnp.int32), axis=1)
  in_chunk = common.segmented_cumsum(reset.astype(jnp.int32), chunk_start, axis=1)
  return chunk_start | reset, (in_chunk == 0).astype(jnp.float32), pid


def write_dtype(dtype, interpret=None):
  """The dtype a caller that computes the write direction (the KDN gain) should store it in for
  delta_rule on q/k/v data of `dtype`: the storage of the kernels' dot operands (bfloat16 under
  bf16-operand dots, tiles.operand_dtype: half the bytes of the pair kernel's column loads, which
  bound it); float32 on the TPU kernels (whose gain writes fp32)."""
  interpret = common.resolve_interpret(interpret)
  if tpu_common.use_tpu_kernels(interpret):
    return jnp.float32
  return _tiles.operand_dtype(_tiles.kernel_precision(common.precision_for(dtype), interpret))


def stage_inputs(
  q,
  k,
  v,
  log_alpha,
  write,
  scale,
  initial_state,
  segment_ids=None,
  *,
  chunk_size=64,
  precision=None,
  interpret=None,
  config=None,
):
  """delta_rule's arguments as its stages read them: ((q, k, v, w, la, h0, starts, cont, pid)
  padded to whole chunks, with la [B, T, H, K] and h0 fp32; {chunk, scale, interpret, cfg,
  prec}, forward_stages' and backward_stages' static arguments). Validates the arguments (one
  error naming the bad one) before any work."""
  interpret = common.resolve_interpret(interpret)
  precision = common.precision_for(q.dtype) if precision is None else precision
  common.dot_precision(precision)  # validates the name before any work
  bsz, t, _, kd = k.shape
  common.check_width("K", kd)
  common.check_width("V", v.shape[-1])
  if chunk_size not in (16, 32, 64, 128):
    raise NotImplementedError(f"delta_rule: chunk_size={chunk_size} not supported")
  cfg = tuned.config("delta_rule", config, interpret)
  chunk = chunk_length(cfg, chunk_size, t, interpret)
  t_pad = -(-t // chunk) * chunk
  la = log_alpha  # the cumsum (or pair) kernel reads it in its own dtype and sums in fp32
  if la.ndim == 3:
    la = jnp.broadcast_to(la[..., None], la.shape + (kd,))
  if isinstance(scale, jax.core.Tracer):
    # A traced scale cannot be a kernel constant: fold it into q (fp32) instead.
    q, scale = q.astype(jnp.float32) * scale, 1.0
  if write.ndim == 3 and tpu_common.use_tpu_kernels(interpret):
    write = write[..., None] * k  # (the TPU kernels read a [B, T, H, K] write)
  q, k, v, w, la = (common.pad_time(x, t_pad) for x in (q, k, v, write, la))
  starts, cont, pid = segment_arrays(segment_ids, bsz, t, t_pad, chunk)
  args = (q, k, v, w, la, initial_state.astype(jnp.float32), starts, cont, pid)
  return args, dict(chunk=chunk, scale=float(scale), interpret=interpret, cfg=cfg, prec=precision)


def delta_rule(
  q,
  k,
  v,
  log_alpha,
  write,
  scale,
  initial_state,
  segment_ids=None,
  *,
  chunk_size=64,
  precision=None,
  interpret=None,
  output_chunk_states=False,
  config=None,
):
  """S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T,  o_t = scale * S_t^T q_t.

  q, k: [B,T,H,K]; write: [B,T,H,K], or [B,T,H] for a per-token scalar beta with write = beta k
  (DeltaNet's, KDA's and the isotropic KDN's: formed inside the kernels, its gradient is beta's);
  v: [B,T,H,V]; log_alpha: [B,T,H,K] or [B,T,H]; initial_state: [B,H,K,V] float32; segment_ids:
  [B,T] int or None. precision: 'fast' (bf16-operand or TF32 dots, for bf16/fp16 data) or
  'exact' (fp32-accurate dots); None picks from q.dtype. Returns (o [B,T,H,V] q.dtype,
  S_final [B,H,K,V] f32).

  output_chunk_states: also return (states [B, H, NC, K, V] f32, C): the state entering each
  chunk of C tokens (state n is the state after token n C - 1, before any reset at token n C),
  NC >= ceil(T / C); differentiable. Not on the TPU kernels.

  config: a DeltaRuleConfig (static: part of jit's cache key); None: the tuned one for the device
  (pallas_kernels/tuned.py).
  """
  out_dtype, t = q.dtype, q.shape[1]
  args, static = stage_inputs(
    q,
    k,
    v,
    log_alpha,
    write,
    scale,
    initial_state,
    segment_ids,
    chunk_size=chunk_size,
    precision=precision,
    interpret=interpret,
    config=config,
  )
  chunk, scale, interpret, cfg, precision = (
    static[n] for n in ("chunk", "scale", "interpret", "cfg", "prec")
  )
  if output_chunk_states:
    if tpu_common.use_tpu_kernels(interpret):
      raise NotImplementedError(
        "delta_rule: output_chunk_states is not available on the TPU "
        "kernels (their backward takes no state cotangents)"
      )
    # fp32 states: they are returned, not only read back by the backward's bf16 dots
    cfg_states = dataclasses.replace(cfg, bf16_states=False)
    o, sfin, states = _core_states(*args, chunk, scale, interpret, cfg_states, precision)
    return o[:, :t].astype(out_dtype), sfin, states, chunk
  o, sfin = _core(*args, chunk, scale, interpret, cfg, precision)
  return o[:, :t].astype(out_dtype), sfin
