"""A serial loop inside a kernel with its loads issued ahead of the steps that use them.

The decay cumsum and causal conv kernels walk rows one after another (their carries: the running
sum, the previous inputs), and each step reads a row or two of its own. A GPU warp issues in
order, so in a plain loop the next step's loads wait behind this step's first use of its own: one
memory round trip per step, which bounds such a loop when its steps do little arithmetic (H200,
T=16384, blocks of 8: the cumsum 0.41 -> 0.35 ms, the reverse cumsum 1.02 -> 0.82; the KDN
layers' forward 0.5-2.5% faster with the conv's, fwd+bwd 0.07-0.6%). It does not pay where
the steps' own arithmetic is the bound: the gain kernels' token loops got slower with it
(docs/decisions.md, `token_block`): one warp per program, 32 programs per SM, and a token step
of a few hundred instructions per thread keep the schedulers busy, so there is no wait to hide,
and the unrolled blocks cost registers.

`blocked_loop` issues the loads of `block` consecutive steps together and, with `ahead`, those
of the next block before this block's steps run (carried through the loop), so a round trip is
paid once per block or hidden behind the steps. Pallas' Triton lowering has no unrolled
`fori_loop`; the block's steps are unrolled here in Python (block copies of the step in the
kernel). The steps' arithmetic and its order are unchanged (results agree with the plain loop's
up to the compiler's choices, e.g. fused multiply-adds: 1 ulp in interpret mode on CPU).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["blocked_loop"]


def blocked_loop(n, block, load, step, carry, ahead=True):
  """carry = step(i, load(i), carry) for i = 0 .. n-1; returns the final carry.

  n: the step count, a Python int or a traced int32 (a program id's function); steps after the
  last whole block run one at a time. load(i): the step's reads (a pytree of arrays); it may be
  called with any index in [0, max(n, 1)) more than once and in any order (with `ahead` the
  block after the last is loaded clamped to step n-1 and dropped), so it must not write.
  block=1: a plain fori_loop (load inside the step)."""
  if block < 1:
    raise ValueError(f"blocked_loop: block must be >= 1, got {block}")
  if block == 1:
    return lax.fori_loop(0, n, lambda i, c: step(i, load(i), c), carry)
  if isinstance(n, int) and n < block:  # no whole block: the plain loop
    return lax.fori_loop(0, n, lambda i, c: step(i, load(i), c), carry)
  whole = n // block
  last = jnp.maximum(n - 1, 0) if not isinstance(n, int) else max(n - 1, 0)

  def grab(j):
    return [load(jnp.minimum(j * block + u, last)) for u in range(block)]

  def run(j, rows, c):
    for u in range(block):
      c = step(j * block + u, rows[u], c)
    return c

  if ahead:

    def body(j, state):
      c, rows = state
      nxt = grab(j + 1)  # issued before this block's steps wait on anything
      return run(j, rows, c), nxt

    carry, _ = lax.fori_loop(0, whole, body, (carry, grab(0)))
  else:
    carry = lax.fori_loop(0, whole, lambda j, c: run(j, grab(j), c), carry)
  if isinstance(n, int) and n % block == 0:
    return carry
  return lax.fori_loop(whole * block, n, lambda i, c: step(i, load(i), c), carry)
