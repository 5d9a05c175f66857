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


def resolve_impl(op, impl):
  """'auto' -> 'pallas' on GPU/TPU when the kernels import, else 'chunked'."""
  check_impl(op, impl)
  if impl != "auto":
    return impl
  if jax.default_backend() in ("gpu", "tpu") and pallas_module() is not None:
    return "pallas"
  return "chunked"
