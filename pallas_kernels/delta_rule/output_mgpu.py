"""Output stage on the Mosaic GPU backend (issue 18): O = Qbar S_0 + P Delta with Hopper wgmma.

Why: jax 0.11 deprecates Pallas's Triton backend in favour of Mosaic GPU. This is the same stage
as output.output_forward (same arguments with g given and no out_dtype, same result), written
for Mosaic GPU as a trial port:
one CTA (one warpgroup, 128 threads) per (V block, chunk, batch head), output.py's grid. The
tiles come in by TMA (copy_gmem_to_smem, one barrier each), the two dots are bf16 wgmma with an
fp32 register accumulator:

    acc  = P [C, C] @ Delta [C, BV]            issued first: needs no arithmetic
    Qbar = scale q exp(g) -> bf16 -> SMEM      computed while that wgmma runs
    acc += Qbar [C, K] @ S_0 [K, BV]
    O    = acc -> SMEM -> TMA store            in q's dtype

Entry point: plgpu.kernel (a mesh kernel: grid, grid_names, scratch_types) with Warpgroup
lowering semantics, the way jax's hopper_matmul_mgpu.py enters the backend. A plain
pl.pallas_call of output.py's kernel with plgpu.CompilerParams does not lower: without
BlockSpecs every operand is staged whole into SMEM ("Mosaic GPU kernel exceeds available shared
memory").

Scope (each limit raises NotImplementedError naming the argument): no segments (`cont` must be
None; output.py's Qbar (1 - cont) S_init term needs a [C] row vector broadcast over [C, K], which
failed Warpgroup layout inference in jax 0.10.2), chunk 64 only (one 64-row wgmma M tile: the
config at chunk 64, DeltaRuleConfig(max_chunk=64, min_chunk=64)), bf16-operand
dots only (cfg_prec='fast' with cfg.fast_dots='bf16'; TF32 wgmma takes only K-major operands, and
S_0 and Delta are V-major). fp32 chunk-start states (bf16_states=False) are cast to bf16 before
the kernel (an XLA pass over the largest array). SMEM per CTA at K = V = 128, bf16 data: 104 KiB
(Qbar reuses q's tile, O Delta's), so two CTAs fit on an H200 SM.

interpret=True runs the kernel in jax's GPU interpret mode (InterpretGPUParams, a private jax
module in 0.10 and 0.11): on CPU it simulates SMEM, barriers, TMA copies and wgmma.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.delta_rule.tiles import BF16_OPERANDS, kernel_precision

try:  # the Mosaic GPU Pallas API; absent or broken in some jax builds
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the jax build
  pl = plgpu = None
  _IMPORT_ERROR = e

CHUNK = 64  # wgmma's M tile on one warpgroup
_BF16 = jnp.bfloat16


class MosaicGPUUnavailable(RuntimeError):
  """Neither a Hopper GPU with Mosaic GPU nor GPU interpret mode is available."""


def _interpret_params(interpret):
  """jax's GPU interpret mode parameters for interpret=True (an instance passes through)."""
  if interpret is True:
    try:
      from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise MosaicGPUUnavailable(
        f"output_mgpu: interpret=True needs jax's GPU interpret mode (jax {jax.__version__}: {e})"
      ) from e
    return InterpretGPUParams()
  return interpret or None


def check_backend(interpret):
  """Raises MosaicGPUUnavailable unless the kernel can run here: a compute capability 9.x GPU
  (wgmma is Hopper-only), or interpret mode."""
  if plgpu is None:
    raise MosaicGPUUnavailable(
      f"output_mgpu: jax {jax.__version__} has no usable "
      f"jax.experimental.pallas.mosaic_gpu ({_IMPORT_ERROR})"
    )
  if interpret:
    return
  if jax.default_backend() != "gpu":
    raise MosaicGPUUnavailable(
      f"output_mgpu: the Mosaic GPU kernel needs a CUDA GPU (backend is "
      f"{jax.default_backend()!r}); pass interpret=True to run it in GPU interpret mode"
    )
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None or not str(cc).startswith("9."):
    raise MosaicGPUUnavailable(
      f"output_mgpu: wgmma needs a Hopper GPU (compute capability 9.x), got {cc!r} "
      f"({jax.devices()[0].device_kind})"
    )


def _kernel(
  q_ref, g_ref, p_ref, d_ref, s_ref, o_ref, q_s, g_s, p_s, d_s, s_s, *extra, scale, nh, block_v
):
  """One (V block, chunk, batch head): refs *_ref in GMEM, tiles *_s in SMEM. extra: the Qbar
  and O tiles where they cannot reuse q's and Delta's (q or O not bf16), then the barriers."""
  *tiles, bars = extra
  qb_s = tiles.pop(0) if q_s.dtype != _BF16 else q_s  # Qbar overwrites q once it is read
  o_s = tiles.pop(0) if o_ref.dtype != _BF16 else d_s  # O overwrites Delta after the wgmma
  vb, c, bh = lax.axis_index("v"), lax.axis_index("c"), lax.axis_index("bh")
  b, h = bh // nh, bh % nh
  rows = pl.ds(c * CHUNK, CHUNK)
  cols = pl.ds(vb * block_v, block_v)
  loads = (
    (p_ref.at[b, h, rows, :], p_s),
    (d_ref.at[b, rows, h, cols], d_s),
    (q_ref.at[b, rows, h, :], q_s),
    (g_ref.at[b, rows, h, :], g_s),
    (s_ref.at[b, h, c, :, cols], s_s),
  )
  for i, (src, dst) in enumerate(loads):  # all five in flight at once
    plgpu.copy_gmem_to_smem(src, dst, bars.at[i])

  def dots(acc):
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    plgpu.wgmma(acc, p_s, d_s)  # P Delta, asynchronous
    plgpu.barrier_wait(bars.at[2])
    plgpu.barrier_wait(bars.at[3])
    qbar = (scale * q_s[...].astype(jnp.float32)) * jnp.exp(g_s[...])
    qb_s[...] = qbar.astype(_BF16)
    plgpu.commit_smem()  # the stores, before wgmma reads qb_s
    plgpu.barrier_wait(bars.at[4])
    plgpu.wgmma(acc, qb_s, s_s)  # + Qbar S_0
    plgpu.wgmma_wait(0)
    return acc[...]

  o = pl.run_scoped(dots, plgpu.ACC((CHUNK, block_v), jnp.float32))
  o_s[...] = o.astype(o_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, rows, h, cols])
  plgpu.wait_smem_to_gmem(0)


def check_args(q, g, pmat, delta, states, cont, *, chunk, cfg, cfg_prec, interpret):
  """Shape, dtype and scope checks (plain Python, before any tracing of the kernel)."""
  if cont is not None:
    raise NotImplementedError(
      "output_mgpu.output_forward: cont (segments, the Qbar (1 - cont) S_init term) is not "
      "supported by the Mosaic GPU output kernel; use output.output_forward"
    )
  if chunk != CHUNK:
    raise NotImplementedError(
      f"output_mgpu.output_forward: chunk={chunk}; the Mosaic GPU "
      f"kernel needs chunk={CHUNK} (one 64-row wgmma tile)"
    )
  prec = kernel_precision(cfg, cfg_prec, bool(interpret))
  if prec != BF16_OPERANDS:
    raise NotImplementedError(
      f"output_mgpu.output_forward: cfg_prec={cfg_prec!r} (fast_dots={cfg.fast_dots!r}); only "
      "bf16-operand dots (cfg_prec='fast', fast_dots='bf16') are ported to wgmma"
    )
  bsz, t, nh, kd = q.shape
  vd = delta.shape[-1]
  nc = t // chunk
  want = {
    "g": (g, (bsz, t, nh, kd)),
    "pmat": (pmat, (bsz, nh, t, chunk)),
    "delta": (delta, (bsz, t, nh, vd)),
    "states": (states, (bsz, nh, nc, kd, vd)),
  }
  for name, (x, shape) in want.items():
    if tuple(x.shape) != shape:
      raise ValueError(
        f"output_mgpu.output_forward: {name} has shape {tuple(x.shape)}, expected {shape}"
      )
  if t % chunk:
    raise ValueError(f"output_mgpu.output_forward: T={t} is not a multiple of chunk={chunk}")
  common.check_width("K", kd)
  common.check_width("V", vd)
  for name, x in (("pmat", pmat), ("delta", delta)):
    if x.dtype != _BF16:
      raise ValueError(
        f"output_mgpu.output_forward: {name} must be bfloat16 (the operand dtype "
        f"of bf16-operand dots), got {x.dtype}"
      )
  if states.dtype not in (_BF16, jnp.float32):
    raise ValueError(
      f"output_mgpu.output_forward: states must be bfloat16 or float32, got {states.dtype}"
    )
  if q.dtype not in (_BF16, jnp.float32, jnp.float16) or g.dtype != jnp.float32:
    raise ValueError(
      f"output_mgpu.output_forward: q must be bf16/fp16/fp32 and g float32, got "
      f"q {q.dtype}, g {g.dtype}"
    )


def kernel_call(q, g, pmat, delta, states, *, scale, block_v, interpret=None):
  """The Mosaic GPU kernel on checked arguments (output_forward checks them and the backend).
  interpret: None (compiled), True (GPU interpret mode) or an InterpretGPUParams."""
  bsz, t, nh, kd = q.shape
  vd = delta.shape[-1]
  out_dtype = q.dtype
  # No SMEM transforms: Warpgroup layout inference picks each tile's tiling and swizzle (explicit
  # (8, find_swizzle) transforms failed it for widths < 64).
  scratch = [
    plgpu.SMEM((CHUNK, kd), q.dtype),  # q (and Qbar, wgmma A, when q is bf16)
    plgpu.SMEM((CHUNK, kd), jnp.float32),  # g
    plgpu.SMEM((CHUNK, CHUNK), _BF16),  # P (wgmma A)
    plgpu.SMEM((CHUNK, block_v), _BF16),  # Delta (wgmma B; and O when O is bf16)
    plgpu.SMEM((kd, block_v), _BF16),  # S_0 (wgmma B)
  ]
  if q.dtype != _BF16:
    scratch.append(plgpu.SMEM((CHUNK, kd), _BF16))  # Qbar
  if out_dtype != _BF16:
    scratch.append(plgpu.SMEM((CHUNK, block_v), out_dtype))  # O, staged for the TMA store
  scratch.append(plgpu.Barrier(num_barriers=5))
  kernel = plgpu.kernel(
    functools.partial(_kernel, scale=float(scale), nh=nh, block_v=block_v),
    out_type=jax.ShapeDtypeStruct((bsz, t, nh, vd), out_dtype),
    scratch_types=scratch,
    grid=(vd // block_v, t // CHUNK, bsz * nh),
    grid_names=("v", "c", "bh"),
    kernel_name="delta_rule_output_mgpu",
    # Warpgroup semantics: the default from jax 0.11, not in 0.10 (Lane).
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=_interpret_params(interpret),
  )
  return kernel(q, g, pmat, delta, states.astype(_BF16))


def output_forward(q, g, pmat, delta, states, h0, cont, *, chunk, scale, interpret, cfg, cfg_prec):
  """O [B, T, H, V] in q's dtype, as output.output_forward with g given (q, not Qbar; h0 is
  unused without segments).
  interpret=True runs jax's GPU interpret mode (CPU is fine); else a Hopper GPU is needed."""
  del h0
  check_args(
    q, g, pmat, delta, states, cont, chunk=chunk, cfg=cfg, cfg_prec=cfg_prec, interpret=interpret
  )
  check_backend(interpret)
  return kernel_call(
    q,
    g,
    pmat,
    delta,
    states,
    scale=scale,
    block_v=min(cfg.block_v_parallel, delta.shape[-1]),
    interpret=interpret,
  )
