"""Test-session setup before jax is imported anywhere: 8 simulated CPU devices (sharding tests),
and XLA:CPU's cheapest compile (inherited by the tests' subprocesses; tests/runner_helpers.
one_device_env drops only the simulated devices). The suite is compile-bound on CPU
(interpret-mode kernels lower to large programs):
- jax_disable_most_optimizations: XLA's backend at its lowest optimisation level (a clean-clone
  `.ci/run` 21m05s -> 16m20s on 2 cores);
- --xla_cpu_use_fusion_emitters=false: XLA:CPU's loop emitters instead of its MLIR fusion
  emitters (a Pallas delta-rule fwd+bwd in interpret mode compiles in 0.96 s instead of 2.67;
  the suite 1972 -> 1180 worker-seconds, 16m51s -> 10m13s on 2 cores).
Neither changes what a program computes: the first changes code generation only, the second
also which elementwise ops XLA:CPU fuses; both can change the order of some fp32 reductions
(~1e-7 relative)."""

import os

os.environ.setdefault(
  "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_use_fusion_emitters=false"
)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture
def optimized_xla():
  """XLA's full backend optimisation for one test: for the few whose time is spent running a
  compiled program many times (a training loop) rather than compiling it. (XLA_FLAGS are read
  once per process, so these still run with the loop emitters above.)"""
  import jax  # pylint: disable=g-import-not-at-top

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


# XLA:CPU maps memory for every executable it compiles and keeps each one while jax's caches
# hold it; one worker running a few hundred tests reaches Linux's vm.max_map_count (65530) and
# the next compile dies with a segfault, in whichever test comes next (docs/decisions.md). A
# worker drops jax's caches whenever its mappings pass MAX_MAPS.
MAX_MAPS = 20000


def _mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:  # not Linux: no such limit to keep under
    return 0


@pytest.fixture(autouse=True)
def _bounded_mappings():
  yield
  if _mappings() > MAX_MAPS:
    import gc  # pylint: disable=g-import-not-at-top

    import jax  # pylint: disable=g-import-not-at-top

    jax.clear_caches()
    gc.collect()
