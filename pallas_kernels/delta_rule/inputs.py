"""delta_rule's arguments as its stages read them: validated (one error naming the bad one),
padded to whole chunks, with the segment bookkeeping and the chunk length."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common, tpu_common, tuned
from pallas_kernels.delta_rule import tiles as _tiles
from pallas_kernels.delta_rule.config import GPU_CHUNK


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
  common.check_chunk_width("delta_rule", "K", kd)
  common.check_chunk_width("delta_rule", "V", v.shape[-1])
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
