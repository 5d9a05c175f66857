"""Test-session setup before jax is imported anywhere: 8 simulated CPU devices (sharding tests),
and XLA's backend at its lowest optimisation level (jax_disable_most_optimizations; inherited by
the tests' subprocesses). The suite is compile-bound on CPU (interpret-mode kernels lower to
large programs): this cuts it by about a quarter on 2 cores. It leaves the HLO passes, and so
what the tests check, alone; only LLVM's code generation (and with it the order of some fp32
reductions, ~1e-7 relative) changes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture
def optimized_xla():
  """XLA's full backend optimisation for one test: for the few whose time is spent running a
  compiled program many times (a training loop) rather than compiling it."""
  import jax  # pylint: disable=g-import-not-at-top
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
