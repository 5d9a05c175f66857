"""Which implementation runs: `impl` names, the platform default and the
limits of the Pallas kernels."""

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


def warm_kernel_imports():
  """Before a program's first jit: pallas_kernels.warm_imports() (jax's lazily imported Pallas
  modules, which on jax 0.11.2 + CUDA registered a jit tracing-context value inside the first
  train step's trace, so the step compiled again at step 2). No-op without the kernels."""
  kernels = pallas_module()
  if kernels is not None:
    kernels.warm_imports()


# Platforms on which 'auto' picks the Pallas kernels. GPU: on the H200 the
# kernels beat the XLA chunked form (diag KDN fwd+bwd T=4096: 9.8 ms against
# 26.7 ms; docs/decisions.md). Not TPU: its BlockSpec kernels
# (pallas_kernels/*/tpu*.py, selected by impl='pallas' there) are checked in
# TPU interpret mode on CPU only; 'auto' stays chunked until a TPU run
# (experiments/benchmarks/tpu_first_run.sh) shows them exact and faster.
PALLAS_AUTO_PLATFORMS = ("gpu",)

# 'auto' on the CPU: the token loop ('reference') while its backward's per-token
# states (B*T*H*K*V fp32, what a differentiated scan keeps) stay under this
# size, else 'chunked'. Measured on 2 CPU cores at T=4096
# (experiments/benchmarks/cpu_impl_choice.py): with B=1, H=2, K=V=32 (33 MB of
# states) the loop compiles 12x (forward) / 13x (forward+backward) faster than
# chunked and also runs faster (diag_kdn forward 18 vs 45 ms, fwd+bwd 0.19 vs
# 0.41 s); with B=4, H=4, K=V=64 (268 MB) the loop still compiles 5-8x faster
# and its forward is faster, but its backward runs 1.7x (diag_kdn) to 3.9x
# (gated_delta_rule) slower and holds those states.
CPU_REFERENCE_MAX_STATE_BYTES = 64 * 2**20

# Pallas chunk length when the caller passes chunk_size=None.
PALLAS_DEFAULT_CHUNK = 64


def pallas_unsupported(kernels, kd, vd, chunk_size):
  """Why the kernels cannot run this call (a sentence), or None when they can.

  chunk_size None means the Pallas default. The limits are the kernels' own
  (pallas_kernels.common), read here so that the choice is made before any
  kernel is traced instead of by catching the kernels' errors. Any K up to the
  widest kernel width and any V run (kdn_jax.ops.widths pads and tiles them).
  """
  del vd  # (any V: column tiles)
  widest = max(kernels.common.CHUNK_WIDTHS)
  chunks = kernels.common.SUPPORTED_CHUNKS
  if kd > widest:
    return f"K (key width) = {kd} is not supported by the Pallas kernels (at most {widest})"
  if chunk_size is not None and chunk_size not in chunks:
    return (
      f"chunk_size = {chunk_size} is not supported by the Pallas kernels "
      f"(supported: {', '.join(map(str, chunks))} or None)"
    )
  return None


def family_config(kernel_config, family):
  """The config of one kernel family ('delta_rule', 'gain', 'conv', 'norm', 'decode') in an op's
  `kernel_config` (a pallas_kernels.KernelConfigs, or None): None means the kernels' tuned
  config for the device (pallas_kernels/tuned.py)."""
  return None if kernel_config is None else getattr(kernel_config, family)


def native_width(n):
  """Whether the kernels take width n as it is (no padding): the layers' glue kernels (short
  conv, gated norm, fused gain front-end) run only at such widths."""
  kernels = pallas_module()
  return kernels is not None and n in kernels.common.SUPPORTED_WIDTHS


_FALLBACKS_LOGGED = set()


def _log_fallback(op, reason):
  """Logs each distinct (op, reason) of an 'auto' fallback once per process
  (ops are traced again for every new shape; one line per cause is enough)."""
  if (op, reason) not in _FALLBACKS_LOGGED:
    _FALLBACKS_LOGGED.add((op, reason))
    logging.warning("%s: impl='auto' uses 'chunked': %s", op, reason)


def resolve_impl(op, impl, kd=None, vd=None, chunk_size=None, state_bytes=None):
  """The implementation that runs.

  'auto' -> 'pallas' on PALLAS_AUTO_PLATFORMS when the kernels import and
  support (kd, vd, chunk_size), else 'chunked' (the reason logged once); on
  the CPU 'reference' when ``state_bytes`` (the per-token states of the call,
  B*T*H*K*V*4) is given and at most CPU_REFERENCE_MAX_STATE_BYTES.
  An explicit 'pallas' never falls back: an unsupported width or chunk size
  raises ValueError naming the value and what is supported. kd / vd None
  skip the width checks (callers that only need the name).
  """
  check_impl(op, impl)
  if impl not in ("auto", "pallas"):
    return impl
  if impl == "auto" and jax.default_backend() not in PALLAS_AUTO_PLATFORMS:
    if (
      jax.default_backend() == "cpu"
      and state_bytes is not None
      and state_bytes <= CPU_REFERENCE_MAX_STATE_BYTES
    ):
      return "reference"
    return "chunked"
  kernels = pallas_module()
  if kernels is None:
    if impl == "pallas":
      raise NotImplementedError(f"{op}: impl='pallas' but pallas_kernels cannot be imported")
    _log_fallback(op, "pallas_kernels cannot be imported")
    return "chunked"
  reason = None if kd is None else pallas_unsupported(kernels, kd, vd, chunk_size)
  if reason is None:
    return "pallas"
  if impl == "pallas":
    raise ValueError(
      f"{op}: impl='pallas': {reason}; use impl='chunked' (or 'auto', which falls back to it)"
    )
  _log_fallback(op, reason)
  return "chunked"


# Platforms on which a decode step's 'auto' picks the fused Pallas step (pallas_kernels.decode).
# None yet: the kernel is exact in interpret mode on CPU but has not run on a GPU; 'auto' keeps
# the XLA step until experiments/benchmarks/decode.py shows it exact and faster there.
DECODE_PALLAS_AUTO_PLATFORMS = ()


def _decode_unsupported(kernels, kd, vd):
  """Why the fused decode step cannot take these widths, or None: it runs at the kernels' own
  widths only (one token has too little work to be worth padding the state)."""
  widths = kernels.common.SUPPORTED_WIDTHS
  for name, n in (("K (key width)", kd), ("V (value width)", vd)):
    if n not in widths:
      return f"{name} = {n} is not a width of the fused decode step (supported: {widths})"
  return None


def resolve_step_impl(op, impl, kd, vd):
  """The implementation of a decode step: 'pallas' (the fused step) or 'reference' (the XLA step;
  'chunked' means it too, a single token having no chunks). 'auto' -> 'pallas' on
  DECODE_PALLAS_AUTO_PLATFORMS when the kernels import and take (kd, vd), else 'reference'; an
  explicit 'pallas' never falls back (an unsupported width raises ValueError naming it)."""
  check_impl(op, impl)
  if impl in ("reference", "chunked"):
    return "reference"
  if impl == "auto" and jax.default_backend() not in DECODE_PALLAS_AUTO_PLATFORMS:
    return "reference"
  kernels = pallas_module()
  reason = (
    "pallas_kernels cannot be imported" if kernels is None else _decode_unsupported(kernels, kd, vd)
  )
  if reason is None:
    return "pallas"
  if impl == "pallas":
    raise ValueError(f"{op}: impl='pallas': {reason}; use impl='reference' (or 'auto')")
  _log_fallback(op, reason)
  return "reference"
