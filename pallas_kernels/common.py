"""Shared helpers for the Pallas kernels: backend selection, padding, segment bookkeeping.

Everything here is plain JAX (runs in XLA around the kernels); the kernels themselves live in the
per-op folders.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
  "kernel_backend",
  "resolve_interpret",
  "compiler_params",
  "dot_precision",
  "precision_for",
  "pad_time",
  "reset_flags",
  "segmented_cumsum",
  "check_width",
  "check_chunk_width",
]

# Head widths K and V the decode step and the layers' glue kernels (short conv, gated norm, gain
# front-end) take as they are: one program holds a whole row.
SUPPORTED_WIDTHS = (16, 32, 64, 128)
# Head widths K and V the chunkwise kernels (delta_rule, the gains) take; kdn_jax.ops pads
# narrower widths onto them and splits a wider V into column tiles. Above 128 the delta-rule
# kernels tile K in their intra-chunk programs and hold narrower V blocks
# (DeltaRuleConfig.block_k, wide_block_v, wide_block_v_parallel): at K = V = 256 the 128-column
# blocks need 293 KB of shared memory, more than an H100's 227 KB (docs/decisions.md).
CHUNK_WIDTHS = SUPPORTED_WIDTHS + (256,)
# chunk_size values delta_rule accepts (kdn_jax.ops.dispatch reads both before any kernel runs).
SUPPORTED_CHUNKS = (16, 32, 64, 128)


def kernel_backend():
  """The platform the kernels are built for: jax's default backend (tests/kernels/test_pallas_lowering.py
  patches it to lower the GPU kernels on a CPU machine)."""
  return jax.default_backend()


def resolve_interpret(interpret):
  """`None` -> interpret on CPU, compiled elsewhere; otherwise pass through."""
  if interpret is None:
    return kernel_backend() == "cpu"
  return interpret


def compiler_params(num_warps: int = 4, num_stages: int = 1):
  """Backend-specific compiler params (Triton on GPU; None elsewhere)."""
  if kernel_backend() == "gpu":
    from jax.experimental.pallas import triton as pltr  # pylint: disable=g-import-not-at-top

    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return None


PRECISIONS = ("fast", "exact")


def precision_for(dtype):
  """Default dot precision for inputs of `dtype`: 'exact' for fp32/fp64, 'fast' for bf16/fp16."""
  return "exact" if jnp.dtype(dtype).itemsize >= 4 else "fast"


def dot_precision(mode, interpret=False):
  """Kernel dot precision (fp32 accumulation either way).

  'fast': TF32 tensor-core dots on GPU, enough for bf16/fp16 inputs (the delta-rule kernels
  round the operands to bf16 instead: tiles.kernel_precision). 'exact': fp32-accurate dots;
  on a GPU that is 3xTF32 (split operands, tensor cores) because Triton lowers HIGHEST to
  per-element FMA loops that are an order of magnitude slower and compile slowly; elsewhere
  (interpret mode, TPU) HIGHEST.
  """
  if mode not in PRECISIONS:
    raise ValueError(f"pallas_kernels: precision={mode!r}; expected one of {PRECISIONS}")
  if mode == "fast":
    return lax.Precision.DEFAULT
  if kernel_backend() == "gpu" and not interpret:
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return lax.Precision.HIGHEST


def check_width(name, n):
  if n not in SUPPORTED_WIDTHS:
    raise NotImplementedError(
      f"pallas_kernels: {name}={n} is not supported (supported: {SUPPORTED_WIDTHS}); "
      "use the chunked XLA implementation instead."
    )


def check_chunk_width(op, name, n):
  """A ValueError naming `name` unless the chunkwise kernels take width n (CHUNK_WIDTHS)."""
  if n not in CHUNK_WIDTHS:
    raise ValueError(
      f"{op}: {name} must be <= {max(CHUNK_WIDTHS)} and one of {CHUNK_WIDTHS}, got {name}={n} "
      "(kdn_jax.ops pads other widths onto these and splits a wider V)"
    )


def next_pow2(n):
  """The smallest power of two >= n (n >= 1): block and chunk sizes, Triton's row widths."""
  return 1 << (n - 1).bit_length()


def pad_time(x, t_pad, value=0):
  """Pads axis 1 (time) of `x` to length t_pad."""
  t = x.shape[1]
  if t_pad == t:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, t_pad - t)
  return jnp.pad(x, widths, constant_values=value)


def reset_flags(segment_ids, batch, t, t_pad):
  """[B, t_pad] bool: True where the state is reset to the initial state before the token.

  Token 0 always resets (the sequence starts from the initial state). Padded tokens never reset
  (they continue the last segment and are no-ops).
  """
  if segment_ids is None:
    flags = jnp.zeros((batch, t), bool).at[:, 0].set(True)
  else:
    seg = segment_ids.astype(jnp.int32)
    flags = jnp.concatenate([jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return pad_time(flags, t_pad, False)


def _seg_add(a, b):
  va, ra = a
  vb, rb = b
  return jnp.where(rb, vb, va + vb), ra | rb


def segmented_cumsum(x, starts, axis):
  """Inclusive cumsum along `axis` that restarts where `starts` (broadcastable bool) is True."""
  starts = jnp.broadcast_to(starts, x.shape)
  out, _ = lax.associative_scan(_seg_add, (x, starts), axis=axis)
  return out
