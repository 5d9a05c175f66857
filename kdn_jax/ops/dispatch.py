"""Which implementation runs: `impl` names and the platform default."""

import importlib

import jax
from absl import logging

from kdn_jax.ops.validation import check_impl


def pallas_module():
  """The Pallas kernel package, or None when it is not importable."""
  try:
    return importlib.import_module("pallas_kernels")
  except ImportError as e:  # e.g. an install without the kernels
    logging.log_first_n(logging.WARNING, "pallas_kernels unavailable: %s", 1, e)
    return None


# Platforms on which 'auto' picks the Pallas kernels. GPU: on the H200 the
# kernels beat the XLA chunked form (diag KDN fwd+bwd T=4096: 9.8 ms against
# 26.7 ms; docs/benchmark_mixers.md). Not TPU: the kernels pass Mosaic-TPU
# interpret mode on CPU only, and they take whole arrays without BlockSpecs,
# which a real TPU would have to fit in VMEM.
PALLAS_AUTO_PLATFORMS = ("gpu",)


def resolve_impl(op, impl):
  """'auto' -> 'pallas' on PALLAS_AUTO_PLATFORMS when the kernels import,
  else 'chunked'."""
  check_impl(op, impl)
  if impl != "auto":
    return impl
  if (jax.default_backend() in PALLAS_AUTO_PLATFORMS and
      pallas_module() is not None):
    return "pallas"
  return "chunked"
