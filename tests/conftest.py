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


# A test whose pytest-xdist worker dies in native code runs once more on a fresh worker; a second
# crash fails it. The crashes seen (jax 0.10.2, XLA:CPU, 2-core machines under load) were segfaults
# inside XLA's own compile or executable serialisation, at a different test each run and never at
# the same one twice (docs/decisions.md); the summary line counts the reruns ("N rerun").
_CRASH_RERUNS: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  if crashitem not in _CRASH_RERUNS:
    _CRASH_RERUNS.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report, config):  # pylint: disable=unused-argument
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None
