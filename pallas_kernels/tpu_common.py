"""What the Mosaic-TPU kernels share: when they run, their compiler params, and VMEM accounting.

The TPU kernels (`kdn_gain/tpu.py`, `delta_rule/tpu_forward.py`, ...) move tiles HBM -> VMEM with
BlockSpecs, so a program's live VMEM is set by the block sizes, not by T. `vmem_bytes` counts it
the way Mosaic lays tiles out:
  * a tile's last dim is padded to 128 lanes, its second-last to the sublane tile (8 rows of
    32-bit, 16 of 16-bit: two 16-bit values share a 32-bit sublane), leading dims multiply;
  * every BlockSpec'd input and output is double-buffered (the pipeline fetches block i + 1 while
    the body works on block i; outputs are written back while the next block is computed);
  * scratch (`scratch_shapes`) is allocated once.
SMEM operands (scalars) are not VMEM and are left out. The count leaves out Mosaic's internal
scratch and the body's spilled temporaries; every kernel is held to 16 MiB at B=4,
T=16k, H=16, K=V=128 bf16 (tests/kernels/test_tpu_kernels.py), the default scoped-VMEM limit on some
TPU generations, so the real budget has room for those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import sharding

__all__ = [
  "use_tpu_kernels",
  "per_shard",
  "check_lane_tile",
  "compiler_params",
  "tile_bytes",
  "Block",
  "vmem_bytes",
]

LANES = 128
SUBLANES_32BIT = 8


def use_tpu_kernels(interpret) -> bool:
  """True where the Mosaic-TPU kernels run: on a TPU backend, or in TPU interpret mode (Mosaic's
  semantics simulated on CPU, the only TPU validation without a TPU): `interpret=
  pltpu.InterpretParams(...)`, or any call traced under `pltpu.force_tpu_interpret_mode()`,
  which jax applies to every pallas_call (so the ops' impl='pallas' path can be run that way)."""
  if jax.default_backend() == "tpu":
    return True
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  if isinstance(interpret, pltpu.InterpretParams):
    return True
  # The context manager's state has no public getter; pallas_call reads this same flag.
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top

  forced = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
  return forced is not None and forced.value is not None


def per_shard(interpret, fn, in_dims, out_dims, name):
  """`sharding.per_shard(fn, ...)`, except where the TPU kernels run: there `fn` runs as it is,
  as per_shard already does on a TPU backend (custom_partitioning does not compile there, jax
  #38196); in TPU interpret mode the simulator's ordered io callbacks fail to lower inside
  custom_partitioning under jit (KeyError on OrderedIOEffect, jax 0.10.2)."""
  if use_tpu_kernels(interpret):
    return fn
  return sharding.per_shard(fn, in_dims, out_dims, name)


def check_lane_tile(op, name, width):
  """Compiled on a TPU, a block's minor dim must be a multiple of 128 lanes or the array's whole
  minor dim; the kernels tile [B, T, H*K] by K columns, so K (and V) must be multiples of 128
  there. Interpret mode does not check layouts, so it runs any width (the tests use 16, 32)."""
  if jax.default_backend() == "tpu" and width % LANES:
    raise NotImplementedError(
      f"{op}: {name}={width} is not a multiple of {LANES}, which the Mosaic-TPU kernels' "
      "(rows, K) tiles need; use impl='chunked' on TPU for this width."
    )


def compiler_params(semantics: Sequence[str]):
  """Mosaic params: `semantics` per grid axis, 'parallel' (independent programs: megacore may
  split them across the two TensorCores) or 'arbitrary' (sequential: a carry in scratch)."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  return pltpu.CompilerParams(dimension_semantics=tuple(semantics))


def tile_bytes(shape, dtype) -> int:
  """VMEM bytes of one buffer holding a block of `shape` (squeezed dims already dropped)."""
  itemsize = jnp.dtype(dtype).itemsize
  shape = tuple(shape)
  if len(shape) == 1:
    shape = (1,) + shape
  *lead, rows, cols = shape
  sub = SUBLANES_32BIT * max(1, 4 // itemsize)
  rows_p = -(-rows // sub) * sub
  cols_p = -(-cols // LANES) * LANES
  return math.prod(lead) * rows_p * cols_p * itemsize


@dataclasses.dataclass(frozen=True)
class Block:
  """One VMEM buffer of a kernel: `shape` (squeezed dims dropped), `dtype`, and whether the
  pipeline double-buffers it (BlockSpec'd inputs/outputs: True; scratch: False)."""

  name: str
  shape: tuple
  dtype: object
  pipelined: bool = True

  @property
  def bytes(self) -> int:
    return tile_bytes(self.shape, self.dtype) * (2 if self.pipelined else 1)


def vmem_bytes(blocks: Sequence[Block]) -> int:
  """Live VMEM of one pallas_call: its BlockSpec'd operands twice (double buffering) + scratch."""
  return sum(b.bytes for b in blocks)
