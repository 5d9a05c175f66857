"""The delta rule op and its custom VJPs over the stages: forward in chunk_fwd.py, backward in
chunk_bwd.py, arguments prepared by inputs.stage_inputs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import tpu_common
from pallas_kernels.delta_rule import chunk_bwd, chunk_fwd
from pallas_kernels.delta_rule.inputs import stage_inputs


# A call that is not differentiated runs the primal, _core, which saves nothing; a
# differentiated one runs _core_fwd, whose residuals the backward reads.
@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(9, 14)))
def _core(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  return chunk_fwd.forward(
    False, (q, k, v, w, la, h0, starts, cont, pid), chunk, scale, interpret, cfg, prec
  )


def _core_fwd(q, k, v, w, la, h0, starts, cont, pid, chunk, scale, interpret, cfg, prec):
  args = (q, k, v, w, la, h0, starts, cont, pid)
  if tpu_common.use_tpu_kernels(interpret):
    o, sfin, states = chunk_fwd.forward(True, args, chunk, scale, interpret, cfg, prec)
    return (o, sfin), (q, k, v, w, la, h0, pid, states)
  o, sfin, *res = chunk_fwd.forward(True, args, chunk, scale, interpret, cfg, prec)
  # (an empty array carries log_alpha's dtype: residuals must be arrays)
  return (o, sfin), (q, k, v, w, h0, starts, cont, pid, res, jnp.zeros((0,), la.dtype))


def _core_bwd(chunk, scale, interpret, cfg, prec, saved, cts):
  if tpu_common.use_tpu_kernels(interpret):
    grads = chunk_bwd.tpu_backward(saved, cts, chunk, scale, interpret, prec)
  else:
    grads = chunk_bwd.backward(saved, *cts, None, chunk, scale, interpret, cfg, prec)
  return grads + (None, None, None)


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
  do, dsfin, dstates = cts
  dstates = dstates.astype(jnp.float32)
  # dext[c]: the cotangent of the state after chunk c, the start state of chunk c + 1 (the last
  # chunk's is S_final's, dsfin); chunk 0's start state is h0, whose gradient it joins directly.
  dext = jnp.concatenate([dstates[:, :, 1:], jnp.zeros_like(dstates[:, :, :1])], axis=2)
  *grads, dh0 = chunk_bwd.backward(saved, do, dsfin, dext, chunk, scale, interpret, cfg, prec)
  return (*grads, dh0 + dstates[:, :, 0], None, None, None)


_core_states.defvjp(_core_states_fwd, _core_states_bwd)


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
