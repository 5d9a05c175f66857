"""The KDN op (the Kalman gain, then the delta rule with write kappa (diag) / beta k (iso) and
erase k) as Pallas kernels under one custom VJP, with the delta rule's chunk-local log-decay
cumsum formed in the gain kernels' token replay and its transpose in the gain's reverse replay
(DeltaRuleConfig.cumsum_in_gain routes ops.diag_kdn / iso_kdn and the KDN layers' fused path
here: `enabled`).

Separately, the gain emits log_alpha (or reads it), the delta rule's cumsum kernel turns it into
g, and in the backward its reverse-cumsum kernel turns dg and the direct log-decay terms into
d log_alpha for the gain's backward: two passes over fp32 [B, T, H, K] arrays that exist only to
carry log_alpha between the two ops. Under one VJP the gain's replay writes g itself (the same
token-order sums) and its reverse replay takes dg and the terms (kdn_gain/kernel.py). Likewise
the iso write w = beta k is formed in the gain's replay and its cotangent split there (write_k),
and the gain's reverse replay adds the delta rule's share of dk before its one store in k's
dtype. The numbers are those of the separate ops up to the order of additions (dk sums the two
ops' parts in fp32 here); tests/test_pallas_kdn.py holds both to each other and to the float64
token loop.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels import sharding as _sharding
from pallas_kernels import tpu_common
from pallas_kernels import kdn_gain as _gain
# (by name: the package attribute `delta_rule` is the function pallas_kernels exports)
from pallas_kernels.delta_rule import call_setup, segment_bookkeeping
from pallas_kernels.delta_rule import forward as _delta_forward
from pallas_kernels.delta_rule import backward as _delta_backward
from pallas_kernels.delta_rule import config as _delta_config  # (enabled)
from pallas_kernels.kdn_gain import config as _gain_config
from pallas_kernels.kdn_gain import kernel as _gain_kernel

__all__ = ["kdn", "enabled"]


def enabled(interpret=None) -> bool:
  """Whether the KDN callers take this op: DeltaRuleConfig.cumsum_in_gain, off the Mosaic-TPU
  kernels (they have their own gain and delta-rule kernels)."""
  return (_delta_config.DEFAULT.cumsum_in_gain
          and not tpu_common.use_tpu_kernels(common.resolve_interpret(interpret)))


@dataclasses.dataclass(frozen=True)
class _Static:
  diag: bool
  front: Any          # r_min (the gate front-end) or None
  scale: float
  chunk: int          # the delta rule's chunk, differentiated calls (residuals for the backward)
  chunk_fo: int       # ... and calls that are not differentiated (DeltaRuleConfig.forward_only)
  gain_chunk: int     # a multiple of both
  interpret: Any
  cfg: Any
  cfg_fo: Any
  gain_cfg: Any
  prec: str


# (batch, head) dims for sharding.per_shard (see delta_rule/__init__.py)
_BTH, _BH, _BT, _H = (0, 2), (0, 1), (0, None), (None, 0)


def _gate_dims(gate):
  """The gate arrays' dims, then mu's."""
  per_token = tuple(_BTH if x.ndim >= 3 else _H for x in gate)
  return per_token + (_H,)   # + mu [H]


def _forward(save, q, k, v, gate, mu, p0, h0, reset, cont, pid, st):
  chunk, cfg = (st.chunk, st.cfg) if save else (st.chunk_fo, st.cfg_fo)

  def body(q, k, v, *rest):
    *gate, mu, p0, h0, reset, cont, pid = rest
    # w: kappa (diag) or beta k (iso, formed in the kernel: write_k); the residual the delta
    # rule's backward reads (the separate ops save it too, iso also beta for the product's VJP)
    w, pprev, pfin, g = _gain_kernel.gain_forward(
        (k, *gate, mu), reset, p0, diag=st.diag, chunk=st.gain_chunk, interpret=st.interpret,
        cfg=st.gain_cfg, save_pprev=save, front=st.front, cumsum_chunk=chunk,
        write_k=not st.diag)
    o, sfin, res = _delta_forward(q, k, v, w, g, h0, cont, pid, chunk=chunk, scale=st.scale,
                                  interpret=st.interpret, cfg=cfg, cfg_prec=st.prec,
                                  save_states=save)
    return (o, sfin, pfin) + ((w, pprev, g) + tuple(res) if save else ())

  lanes = _BTH + (4,)
  outs = (lanes, _BH + (4,), _BH + (3,))
  if save:   # w, p_prev, g; A, P, Wt, W, chunk-start states
    outs += (lanes, lanes, lanes, _BH + (4,), _BH + (4,), lanes, lanes, _BH + (5,))
  dims = (_BTH,) * 3 + _gate_dims(gate) + (_BH, _BH, _BT, _BT, _BT)
  return _sharding.per_shard(body, dims, outs, "kdn forward")(
      q, k, v, *gate, mu, p0, h0, reset, cont, pid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _core(q, k, v, gate, mu, p0, h0, reset, cont, pid, cont_fo, st):
  """(o, S_final, p_final); a call that is not differentiated runs the forward at
  (chunk_fo, cfg_fo) on its own segment bookkeeping cont_fo."""
  return _forward(False, q, k, v, gate, mu, p0, h0, reset, cont_fo, pid, st)


def _core_fwd(q, k, v, gate, mu, p0, h0, reset, cont, pid, cont_fo, st):
  del cont_fo
  o, sfin, pfin, *res = _forward(True, q, k, v, gate, mu, p0, h0, reset, cont, pid, st)
  return (o, sfin, pfin), (q, k, v, gate, mu, h0, reset, cont, pid, res)


def _core_bwd(st, saved, cts):
  q, k, v, gate, mu, h0, reset, cont, pid, res = saved
  do, dsfin, dpfin = cts
  front = st.front is not None

  def body(q, k, v, *rest):
    *gate, mu, h0, reset, cont, pid, w, pprev, g = rest[:-8]
    amat, pmat, wt, wk, states, do, dsfin, dpfin = rest[-8:]
    # dq, dv in their dtypes; the delta rule's share of dk in fp32 for the gain kernel to add
    dq, dk, dv, dw, dg, dla_terms, dh0 = _delta_backward.backward(
        q, k, v, w, g, h0, cont, pid, (amat, pmat, wt, wk, states), do, dsfin, chunk=st.chunk,
        scale=st.scale, interpret=st.interpret, cfg=st.cfg, cfg_prec=st.prec,
        grad_dtypes=(q.dtype, jnp.float32, v.dtype))
    # (iso: the kernel splits dw into beta's share, sum_K dw k, and k's, dw beta)
    d_raw, dp0, *dparams = _gain_kernel.gain_backward(
        (k, *gate, mu), reset, pprev, dw, dpfin, diag=st.diag, chunk=st.gain_chunk,
        interpret=st.interpret, cfg=st.gain_cfg, front=st.front, cumsum_chunk=st.chunk, dg=dg,
        dla_terms=dla_terms, dk_in=dk, dk_dtype=k.dtype, write_k=not st.diag)
    return (dq, d_raw[0], dv, dh0, dp0) + tuple(d_raw[1:]) + tuple(dparams)

  lanes = _BTH + (4,)
  gate_ndims = tuple(x.ndim for x in gate)
  # per-token gradients of the gate arrays: f / log_alpha, omega, r, then mu's per token
  per_token = (lanes, _BTH + (gate_ndims[-2],), _BTH + (3,), _BTH + (3,))
  params = (_BH + (3,), _BH + (2,)) if front else ()   # dt_bias, A_log partials per batch entry
  outs = (lanes, lanes, lanes, _BH + (4,), _BH + (3,)) + per_token + params
  dims = ((_BTH,) * 3 + _gate_dims(gate) + (_BH, _BT, _BT, _BT) + (_BTH,) * 3
          + (_BH, _BH, _BTH, _BTH, _BH, _BTH, _BH, _BH))
  dq, dk, dv, dh0, dp0, *dgate = _sharding.per_shard(body, dims, outs, "kdn backward")(
      q, k, v, *gate, mu, h0, reset, cont, pid, *res, do, dsfin.astype(jnp.float32),
      dpfin.astype(jnp.float32))
  d_first, dom, dr, dmu = dgate[:4]
  if front:   # (f, dt_bias, a_log, omega_raw, r_raw): sums over batch stay outside the shards
    ddt, dalog = dgate[4:]
    dgate = (d_first, ddt.sum(axis=0), dalog.sum(axis=0), dom, dr)
  else:       # (log_alpha, omega, r)
    dgate = (d_first, dom, dr)
  dgate = tuple(d.astype(x.dtype) for d, x in zip(dgate, gate))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgate,
          dmu.sum(axis=(0, 1)).astype(mu.dtype), dp0, dh0, None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def kdn(q, k, v, gate, info_scale, p0, h0, segment_ids=None, *, diag, scale, r_min=None,
        chunk_size=64, gain_chunk_size=256, precision=None, interpret=None):
  """The diagonal (diag=True) or isotropic KDN: the gain recurrence (kdn_gain) gives the write
  direction w (kappa, or beta k), then S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T and
  o_t = scale * S_t^T q_t (delta_rule).

  q, k: [B,T,H,K]; v: [B,T,H,V]; gate: (log_alpha [B,T,H,K], omega [B,T,H,K] (diag) or [B,T,H]
  (iso), r [B,T,H]), or with r_min (a float > 0: the gate front-end inside the kernels, as
  kdn_gain.*_gain_fused) the pre-activations (f [B,T,H,K], dt_bias [H,K], a_log [H], omega_raw,
  r_raw [B,T,H]); info_scale: a float or [H]; p0: the initial variance [B,H,K] (diag) or [B,H]
  (iso); h0: the initial memory [B,H,K,V]; segment_ids [B,T] int or None. chunk_size /
  gain_chunk_size: as delta_rule's / the gain's; precision as delta_rule's (None: from q.dtype).
  Returns (o [B,T,H,V] q.dtype, S_final [B,H,K,V] f32, p_final like p0, f32). Gradients flow to
  every array but segment_ids (info_scale's as that of an [H] array).
  """
  op = "diag_kdn" if diag else "iso_kdn"
  front = r_min is not None
  gate = tuple(gate)
  if len(gate) != (5 if front else 3):
    raise ValueError(f"{op}: gate has {len(gate)} arrays; expected "
                     + ("5 (f, dt_bias, a_log, omega_raw, r_raw) with r_min" if front
                        else "3 (log_alpha, omega, r)"))
  _gain.check_gate(op, diag, front, k, gate, p0)
  if front and not r_min > 0:
    raise ValueError(f"{op}: r_min must be > 0, got {r_min}")
  gain_cfg = _gain_config.DEFAULT
  if gain_cfg.num_warps != 1:
    # The reverse replay reads back rows it stored (kdn_gain.kernel._decay_prefix): with rows
    # narrower than its warps' lanes, another warp's replica could be read with no barrier.
    raise ValueError(f"pallas_kernels.kdn ({op}): GainConfig.num_warps must be 1, got "
                     f"{gain_cfg.num_warps}")
  out_dtype = q.dtype
  q, scale, precision, interpret, cfg, chunk, cfg_fo, chunk_fo = call_setup(
      op, q, k, v, scale, chunk_size, precision, interpret)
  if tpu_common.use_tpu_kernels(interpret):
    raise NotImplementedError(f"pallas_kernels.kdn ({op}): no Mosaic-TPU kernels; compose "
                              "kdn_gain and delta_rule there (kdn.enabled() is False on TPU)")
  bsz, t = k.shape[:2]
  # a power of two (the gain kernels take any chunk; the cumsum pieces must tile it), so t_pad
  # may hold a few more delta-rule chunks than the delta rule alone would pad to
  gain_chunk = max(1 << (_gain.gain_chunk(t, gain_chunk_size) - 1).bit_length(), chunk, chunk_fo)
  t_pad = -(-t // gain_chunk) * gain_chunk
  k_pad, gate, mu, p0 = _gain.kernel_inputs(k, gate, info_scale, p0, t_pad, diag, front)
  q, v = (common.pad_time(x, t_pad) for x in (q, v))
  reset = common.reset_flags(segment_ids, bsz, t, t_pad).astype(jnp.int32)
  _, cont, pid, _, cont_fo = segment_bookkeeping(segment_ids, bsz, t, t_pad, chunk, chunk_fo)
  st = _Static(diag=diag, front=None if r_min is None else float(r_min), scale=scale,
               chunk=chunk, chunk_fo=chunk_fo, gain_chunk=gain_chunk, interpret=interpret,
               cfg=cfg, cfg_fo=cfg_fo, gain_cfg=gain_cfg, prec=precision)
  o, sfin, pfin = _core(q, k_pad, v, gate, mu, p0, h0.astype(jnp.float32), reset, cont, pid,
                        cont_fo, st)
  return o[:, :t].astype(out_dtype), sfin, (pfin if diag else pfin[..., 0])
