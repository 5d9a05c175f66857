"""Non-finite inputs stay inside their segment, and log_alpha = -inf is a full forget.

The token loop confines a NaN (or an infinity) to the rest of its own segment: a reset replaces
the state, and the tokens before it never saw it. The chunkwise forms do not: they mix a chunk's
tokens in matrix products where a masked-out pair still multiplies 0 by the bad value (0 * NaN =
NaN), and they build in-chunk decays from cumulative sums, where one NaN or -inf spoils every
later difference (-inf - -inf = NaN). So the ops that run them:

  1. replace every non-finite value by a harmless finite one (0; r: 1) and log_alpha = -inf by
     the most negative log-decay whose exp is exactly 0 in the compute dtype, so the kernels see
     finite numbers only and a -inf decay forgets the state as exp(-inf) = 0 does;
  2. run the implementation;
  3. write NaN into what the bad values reach in the token loop: a bad q_t spoils o_t; a bad
     k, v, log_alpha (NaN or +inf), write, omega or r at token t spoils o_t .. the end of t's
     segment and, in the last segment, the final memory (and the final variance when it was
     k, log_alpha, omega or r, the inputs of the variance recurrence).

Step 3 is what the token loop gives for NaN; for an infinity the loop's results are non-finite
from the same token on except where the infinity cancels (an infinite r writes nothing at its
own token), which the ops report as NaN too: invalid input, reported rather than half-used.

Where the bad values reach is a scan over T per flag, dozens of small kernels on a GPU, so it
runs under `lax.cond` only when some input is not finite (one read-only reduction decides);
otherwise the masks are zeros.
"""

import jax
import jax.numpy as jnp
import numpy as np


def log_decay_floor(dtype):
  """The most negative log-decay used for -inf: exp of it is exactly 0 in `dtype`, and it is
  small enough in magnitude that cumulative sums around it keep their precision."""
  tiny = float(jnp.finfo(dtype).smallest_subnormal)
  return -float(np.ceil(-np.log(tiny)) + 1.0)


def _token_bad(x, lead=3):
  """[B, T, H] bool: some value of the token (over the dims past [B, T, H]) is not finite."""
  bad = ~jnp.isfinite(x)
  return jnp.any(bad, axis=tuple(range(lead, x.ndim))) if x.ndim > lead else bad


def _bad_log_decay(log_alpha):
  """NaN or +inf (-inf is legal: forget everything)."""
  return jnp.isnan(log_alpha) | (log_alpha == jnp.inf)


def clean(x, fill=0.0):
  return jnp.where(jnp.isfinite(x), x, jnp.asarray(fill, x.dtype))


def clean_log_decay(log_alpha, compute_dtype):
  floor = jnp.asarray(log_decay_floor(compute_dtype), log_alpha.dtype)
  return jnp.where(
    _bad_log_decay(log_alpha), jnp.zeros((), log_alpha.dtype), jnp.maximum(log_alpha, floor)
  )


def _spoiled_from(bad, segment_ids):
  """[B, T, H] bool: a bad token at or before t in t's segment."""
  # (associative scans: XLA:CPU lowers cumsum / cummax over long T to slow-compiling windows)
  count = jax.lax.associative_scan(jnp.add, bad.astype(jnp.int32), axis=1)
  if segment_ids is None:
    return count > 0
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  starts = (segment_ids != prev)[..., None]
  # count before each segment's first token; count is nondecreasing, so is this
  base = jax.lax.associative_scan(
    jnp.maximum, jnp.where(starts, count - bad.astype(jnp.int32), 0), axis=1
  )
  return count > base


class Guard:
  """Steps 1 and 3 for one call: build it from the raw inputs, run the op on `.inputs`, pass
  the results through `spoil`.

  q: [B, T, H, K]; state: the other inputs of the memory recurrence ([B, T, H, *]);
  variance: the inputs of the KDN variance recurrence among them (names), or () for the
  delta rule; r_names: inputs whose stand-in is 1 (a noise variance) rather than 0.
  """

  def __init__(self, q, state: dict, segment_ids, compute_dtype, variance=(), r_names=()):
    self.segment_ids = segment_ids

    def reach(_):
      bad = {
        name: (_bad_log_decay(x) if name == "log_alpha" else ~jnp.isfinite(x))
        for name, x in state.items()
      }
      tok = {
        name: jnp.any(b, axis=tuple(range(3, b.ndim))) if b.ndim > 3 else b
        for name, b in bad.items()
      }
      spoiled = _spoiled_from(_any_of(tok.values()), segment_ids)
      variance_spoiled = (
        _spoiled_from(_any_of(tok[n] for n in variance), segment_ids) if variance else spoiled
      )
      return _token_bad(q), spoiled, variance_spoiled

    def none(_):
      # zeros of every input's own kind (under shard_map, varying along the same mesh axes as
      # the masks `reach` derives from them): a fill, no read
      zero = jnp.zeros(q.shape[:3], bool)
      for x in [q, *state.values()] + ([] if segment_ids is None else [segment_ids[..., None]]):
        zero = zero | jnp.zeros_like(x[..., 0] if x.ndim > 3 else x, dtype=bool)
      return (zero,) * 3

    some_bad = jnp.logical_not(_all_finite([q, *state.values()]))
    self.bad_q, self.spoiled, variance_spoiled = jax.lax.cond(some_bad, reach, none, None)
    self.variance_spoiled = variance_spoiled if variance else None
    inputs = {"q": clean(q)}
    for name, x in state.items():
      if name == "log_alpha":
        inputs[name] = clean_log_decay(x, compute_dtype)
      else:
        inputs[name] = clean(x, 1.0 if name in r_names else 0.0)
    self.inputs = inputs

  def spoil(self, o, memory=None, variance=None):
    """NaN where the bad inputs reach: o [B, T, H, V]; final memory [B, H, K, V]; final
    variance [B, H, K] or [B, H]."""
    nan = lambda x: jnp.asarray(jnp.nan, x.dtype)
    o = jnp.where((self.spoiled | self.bad_q)[..., None], nan(o), o)
    last = self.spoiled[:, -1]
    if memory is not None:
      memory = jnp.where(last[..., None, None], nan(memory), memory)
    if variance is not None:
      last_v = self.variance_spoiled[:, -1]
      variance = jnp.where(
        last_v.reshape(last_v.shape + (1,) * (variance.ndim - 2)), nan(variance), variance
      )
    return o, memory, variance


def _all_finite(arrays):
  """A scalar bool: every value of every array is finite."""
  ok = None
  for x in arrays:
    x_ok = jnp.all(jnp.isfinite(x))
    ok = x_ok if ok is None else ok & x_ok
  return ok


def _any_of(flags):
  out = None
  for f in flags:
    out = f if out is None else out | f
  return out
