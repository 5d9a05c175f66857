"""Token-by-token delta rule: the readable ground truth and the decode step.

S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T,   o_t = S_t^T q_t
(q arrives pre-scaled). Equivalently S_hat = D_t S_{t-1},
delta_t = v_t - S_hat^T k_t, S_t = S_hat + w_t delta_t^T.
"""

import functools

import jax
import jax.numpy as jnp

from kdn_jax.ops.varying import like_varying


def decay_memory(memory, log_alpha):
  """D_t S: per-channel decay [B, H, K] scales rows; scalar [B, H] scales all."""
  alpha = jnp.exp(log_alpha)
  if alpha.ndim == memory.ndim - 1:
    return alpha[..., None] * memory
  return alpha[..., None, None] * memory


def scalar_write(beta, k):
  """The write direction beta k of a per-token scalar beta, formed in fp32 at least: rounding
  the product to 16 bits would lose what the Pallas kernels keep (they apply beta in fp32 after
  their reductions over K)."""
  dt = jnp.promote_types(jnp.promote_types(beta.dtype, k.dtype), jnp.float32)
  return beta.astype(dt)[..., None] * k.astype(dt)


def delta_step(memory, q, k, v, log_alpha, write):
  """One token. memory [B,H,K,V]; q, k, write [B,H,K]; v [B,H,V].

  Returns (o [B,H,V], new memory).
  """
  s_hat = decay_memory(memory, log_alpha)
  delta = v - jnp.einsum("bhkv,bhk->bhv", s_hat, k)
  memory = s_hat + write[..., :, None] * delta[..., None, :]
  return jnp.einsum("bhkv,bhk->bhv", memory, q), memory


def scan_tokens(step, carry0, xs, starts=None):
  """Run `step(carry, x_t) -> (carry, y_t)` over axis 1 of every leaf of xs.

  starts: [B, T] bool or None; where True the carry is reset to carry0
  before the token (packed sequences all start from the initial state).
  """
  xs_t = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)
  ref = jax.tree.leaves(xs)[0]
  carry0 = jax.tree.map(lambda c: like_varying(c, ref), carry0)

  def body(carry, inp):
    x, start = inp
    if start is not None:
      carry = jax.tree.map(
        lambda c, c0: jnp.where(start.reshape(start.shape + (1,) * (c.ndim - 1)), c0, c),
        carry,
        carry0,
      )
    return step(carry, x)

  st = None if starts is None else jnp.moveaxis(starts, 1, 0)
  carry, ys = jax.lax.scan(body, carry0, (xs_t, st))
  return carry, jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1), ys)


@functools.partial(jax.jit, static_argnames="keep_states")
def delta_rule_reference(q, k, v, log_alpha, write, memory0, starts=None, keep_states=False):
  """[B,T,H,*] inputs in the compute dtype. Returns (o [B,T,H,V], memory), and
  with keep_states also the memory after every token [B,T,H,K,V]."""

  def step(memory, x):
    o, memory = delta_step(memory, *x)
    return memory, ((o, memory) if keep_states else o)

  memory, ys = scan_tokens(step, memory0, (q, k, v, log_alpha, write), starts)
  return (ys[0], memory, ys[1]) if keep_states else (ys, memory)
