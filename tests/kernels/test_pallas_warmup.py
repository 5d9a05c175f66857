"""pallas_kernels.warm_imports: after it, tracing a kernel imports no more of jax (jax 0.11.2 + CUDA
registered a jit tracing-context value from such a lazy import inside the first train step, and
the step compiled again at step 2; docs/decisions.md)."""

import subprocess
import sys

_CODE = """
import sys
import jax, jax.numpy as jnp
import pallas_kernels
from kdn_jax import ops
from jax._src import config as jax_config
WARM = {warm}
if WARM:
  pallas_kernels.warm_imports()
before, n_ctx = set(sys.modules), len(jax_config.trace_context())
x = jnp.zeros((1, 20, 1, 16), jnp.float32)
f = lambda q: ops.diag_kdn(q, q, q, -0.1 * jnp.ones_like(q), jnp.ones_like(q), jnp.ones((1, 20, 1)),
                           impl='pallas', chunk_size=16)[0].sum()
jax.jit(jax.grad(f)).lower(x)
print(sorted(m for m in set(sys.modules) - before if m.startswith('jax')))
print(len(jax_config.trace_context()) - n_ctx)
"""


def _run(warm):
  out = subprocess.run(
    [sys.executable, "-c", _CODE.format(warm=warm)], capture_output=True, text=True, check=True
  )
  lines = out.stdout.strip().splitlines()
  return eval(lines[-2]), int(lines[-1])  # pylint: disable=eval-used


def test_tracing_a_kernel_after_warm_imports_imports_nothing_from_jax():
  lazy, _ = _run(warm=False)
  assert lazy, "the premise: without the warm-up, jax imports Pallas modules during the trace"
  lazy, grew = _run(warm=True)
  assert lazy == [] and grew == 0, (lazy, grew)
