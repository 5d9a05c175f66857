"""The gain's forward: the kernels (kernel.py; tpu.py where the Mosaic-TPU kernels run) per
(batch, head) shard, on inputs already padded to whole chunks (inputs.py)."""

from __future__ import annotations

from pallas_kernels import sharding, tpu_common
from pallas_kernels.kdn_gain import kernel as _kernel
from pallas_kernels.kdn_gain import tpu as _tpu

# (batch, head) dims for sharding.per_shard: k, log_alpha, omega, r, per-token gains and
# gradients [B,T,H,...]; mu [H]; reset [B,T]; p0 / p_final [B,H,L]. Results: (batch, head, ndim).
BTH, MU, BT, BH = (0, 2), (None, 0), (0, None), (0, 1)
LANES, PER_TOKEN, P = BTH + (4,), BTH + (3,), BH + (3,)


def raw_dims(front):
  """The raw inputs' dims: (k, log_alpha, omega, r, mu), or with a front (k, f, dt_bias [H,K],
  A_log [H], omega_raw, r_raw, mu)."""
  return (BTH,) * 4 + (MU,) if front is None else (BTH, BTH, MU, MU, BTH, BTH, MU)


def on_tpu_kernels(interpret, front):
  """Whether the Mosaic-TPU kernels run; they have no gate front-end (the fused gain is a GPU
  path), so a front always takes the Triton/generic kernels."""
  return front is None and tpu_common.use_tpu_kernels(interpret)


def forward(
  raw, reset, p0, diag, chunk, interpret, cfg, front, gain_dtype, segmented, *, save_pprev
):
  """(gain [B,T,H,L] in gain_dtype, log_alpha [B,T,H,K] (with a front, else None), p_prev
  [B,T,H,L] (the backward's residual, with save_pprev, else None), p_final [B,H,L]). raw, diag,
  front (r_min or None), segmented: as kernel.gain_forward."""
  tpu = on_tpu_kernels(interpret, front)

  def body(*args):
    raw, (reset, p0) = args[:-2], args[-2:]
    kw = dict(diag=diag, chunk=chunk, interpret=interpret, cfg=cfg, save_pprev=save_pprev)
    if tpu:  # (the TPU kernels always read the reset flags)
      gain, pprev, pfin = _tpu.gain_forward(raw, reset, p0, **kw)
      return gain, None, pprev, pfin
    gain, pprev, pfin, la = _kernel.gain_forward(
      raw, reset, p0, front=front, gain_dtype=gain_dtype, segmented=segmented, **kw
    )
    return gain, la, pprev, pfin

  outs = (LANES, None if front is None else LANES, LANES if save_pprev else None, P)
  name = "kdn_gain forward" if front is None else "kdn_gain_fused forward"
  shard = body if tpu else sharding.per_shard(body, raw_dims(front) + (BT, BH), outs, name)
  gain, la, pprev, pfin = shard(*raw, reset, p0)
  return gain.astype(gain_dtype), la, pprev, pfin  # (the TPU kernels write fp32)
