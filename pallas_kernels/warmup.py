"""Load jax's lazily imported Pallas modules before a caller's first jit.

Lowering the first pallas_call imports parts of jax's Pallas package (lowering, interpreter,
fuser) on demand. On jax 0.11.2 with CUDA one of them registers a jit tracing-context value
(`pallas_fuser_disable_nested_fuse`); registered while a train step is being traced, it changes
the key of the jit cache entry made for that step, so the step is traced and compiled a second
time at step 2 (H200, 125M LM: +28 s per run; docs/decisions.md). The modules it
imported meanwhile came from `jax.experimental.pallas.tpu` (which our kernels import when they
decide between the Mosaic-TPU and the generic kernels) and from lowering a pallas_call; this does
both before the step is traced. (Importing them in pallas_kernels at module level was not enough:
kdn_jax imports pallas_kernels only when a layer first reaches a kernel, inside that trace.)
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def _copy(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def warm_imports(interpret=None) -> None:
  """Lower (not compile) one [16, 128] copy kernel with `interpret` resolved as the kernels do
  (compiled on GPU, interpret mode on CPU). Call it before the first jit that reaches a kernel."""
  # every kernel call imports jax's Mosaic-TPU package (tpu_common.use_tpu_kernels)
  importlib.import_module("jax.experimental.pallas.tpu")
  interpret = common.resolve_interpret(interpret)
  shape = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  jax.jit(lambda x: pl.pallas_call(_copy, out_shape=shape, interpret=interpret)(x)).lower(shape)
