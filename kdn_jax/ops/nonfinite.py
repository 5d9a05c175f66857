"""Non-finite inputs stay inside their segment, and log_alpha = -inf is a full forget.

The token loop confines a NaN (or an infinity) to the rest of its own segment: a reset replaces
the state, and the tokens before it never saw it. The chunkwise forms do not: they mix a chunk's
tokens in matrix products where a masked-out pair still multiplies 0 by the bad value (0 * NaN =
NaN), and they build in-chunk decays from cumulative sums, where one NaN or -inf spoils every
later difference (-inf - -inf = NaN). The guarded result of an op (`Guard`) is therefore:

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

Steps 1 and 3 read every input and write a copy of it, and deciding whether step 3 has
anything to do reads every input again: around the Pallas kernels, whose calls XLA cannot fuse
into, passes over memory that cost more than a quarter of the kernels' forward. So on that path
the ops (`guarded`) run the implementation on the inputs as they are (only a non-finite r made
NaN, [B, T, H]), check that the outputs (o, the final memory and variance) are finite and that
every log_alpha is above the floor (read-only reductions: o is a fraction of the inputs' bytes,
and a layer's jit fuses the one over log_alpha into the op that makes it) and, only when a check
fails, run steps 1-3 under `lax.cond`. That is the guarded result:
  - inputs all finite, log_alpha above the floor: step 1 changes nothing (nor the gradient), and
    step 3 writes nothing; the fast result is the guarded one, and if it overflows the fallback
    computes it again;
  - log_alpha at or below the floor (-inf included): the fallback;
  - some other input not finite: every such value reaches an output as a non-finite value on the
    fast path (a NaN or infinity in q_t, k_t, v_t, write_t, omega_t or log_alpha_t (NaN, +inf)
    multiplies into o_t through S_t^T q_t, and 0 * inf = NaN; the one infinity that cancels, an
    infinite r, is made NaN first), so the fallback runs and returns the guarded result.
The implementation sits between optimization barriers on both paths, so it compiles to the same
arithmetic: a segment next to a bad one gets the bits of the clean run. The gradient is a custom
VJP: the fast path's when its checks passed, else the guarded path's, recomputed in the
backward (a cond whose untaken branch saved residuals would zero-fill them on every call); one
cond per pass. The price: the implementation compiles twice in the forward and three times in
fwd+bwd, and a fallback's temporaries (about one call's residuals) add to the peak.
tests/ops/test_ops_nonfinite.py checks it against `Guard` (the non-finite entries exactly; the
outputs bit for bit on clean input; elsewhere, and the gradients, to an ulp: XLA:CPU compiles the
fallback, inside a cond, with other rounding, and sums a gradient's terms in another order) and
containment (a bad segment's neighbours keep the clean run's bits, gradients included).

Where the bad values reach is a scan over T per flag, dozens of small kernels on a GPU; it runs
only when needed (the fallback; under `Guard` alone, under a cond on an all-finite reduction).
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
  """Steps 1 and 3 for one call (the guarded result's definition; `guarded` runs it only when
  the outputs of the unguarded inputs are not all finite): build it from the raw inputs, run the op on `.inputs`, pass
  the results through `spoil`.

  q: [B, T, H, K]; state: the other inputs of the memory recurrence ([B, T, H, *]);
  variance: the inputs of the KDN variance recurrence among them (names), or () for the
  delta rule; r_names: inputs whose stand-in is 1 (a noise variance) rather than 0.
  """

  def __init__(
    self, q, state: dict, segment_ids, compute_dtype, variance=(), r_names=(), decide=True
  ):
    """decide: find where the bad values reach under a cond on an all-finite reduction of the
    inputs; False: find it unconditionally (the caller knows something is not finite)."""
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

    if decide:
      some_bad = jnp.logical_not(_all_finite([q, *state.values()]))
      self.bad_q, self.spoiled, variance_spoiled = jax.lax.cond(some_bad, reach, none, None)
    else:
      self.bad_q, self.spoiled, variance_spoiled = reach(None)
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


# Which scheme `guarded` traces: "outputs" (check the outputs, fall back to the guarded path),
# "inputs" (`Guard` on every call: the definition) or "none" (no guard: the benchmark's baseline;
# not contained). "outputs" is meant for the Pallas kernels, whose calls cannot fuse the clean
# copies; the XLA impls fuse them into their first ops and compile one program instead of two
# (the CPU test suite is compile-bound), so they keep "inputs". A default path states its cost:
# until a GPU times "outputs" against "inputs" (experiments/benchmarks/nonfinite_guard.py) every
# impl defaults to "inputs"; `scheme` selects another for tests and the benchmark.
SCHEMES = ("outputs", "inputs", "none")
_FAST_IMPLS = ()
_scheme = [None]


class scheme:
  """Context manager: trace the ops' guard with scheme `name` (SCHEMES) inside the block."""

  def __init__(self, name):
    if name not in SCHEMES:
      raise ValueError(f"nonfinite.scheme: name must be one of {SCHEMES}, got {name!r}")
    self.name = name

  def __enter__(self):
    self.prev, _scheme[0] = _scheme[0], self.name

  def __exit__(self, *exc):
    _scheme[0] = self.prev


def fast_inputs(q, state: dict, r_names=()):
  """What the fast path runs on: the inputs as they are, but a non-finite r NaN (an infinite r
  cancels: it writes nothing, so the outputs would stay finite)."""
  inputs = {"q": q, **state}
  for name in r_names:
    x = state[name]
    inputs[name] = jnp.where(jnp.isfinite(x), x, jnp.asarray(jnp.nan, x.dtype))
  return inputs


def above_floor(log_alpha, compute_dtype):
  """A scalar bool: every log_alpha is above the floor (so flooring it changes nothing, nor its
  gradient, and it is not NaN)."""
  return jnp.all(log_alpha > jnp.asarray(log_decay_floor(compute_dtype), log_alpha.dtype))


def guarded(body, impl, q, state: dict, extra: dict, compute_dtype, variance=(), r_names=()):
  """The guarded result of `body` (steps 1-3 of the module docstring), from the fast path when
  its outputs are finite.

  body(inputs, extra) -> (o, final memory, final variance or None, more): inputs is {"q": ..,
  **state} (the names of `Guard`), extra a dict of the other arrays the op reads (the initial
  state, segment_ids under "segment_ids", ...; differentiable where floating); `more` (a pytree,
  e.g. states at positions) is returned as computed. impl: the op's implementation, which picks
  the default scheme. Returns body's four results.
  """
  segment_ids = extra.get("segment_ids")
  names = ("q", *state)
  guard_args = dict(
    segment_ids=segment_ids, compute_dtype=compute_dtype, variance=variance, r_names=r_names
  )

  def run(inputs, extra):
    # (barriers: the implementation compiles to the same program on both paths, so a clean
    # segment's results do not depend on which path ran, down to the last bit)
    return jax.lax.optimization_barrier(body(*jax.lax.optimization_barrier((inputs, extra))))

  def slow(raw, extra, decide=False):
    guard = Guard(raw["q"], {n: raw[n] for n in names[1:]}, decide=decide, **guard_args)
    o, memory, var, more = run(guard.inputs, extra)
    return (*guard.spoil(o, memory, var), more)

  def fast(raw, extra):
    return run(fast_inputs(raw["q"], {n: raw[n] for n in names[1:]}, r_names), extra)

  def fast_ok(raw, out):
    ok = _outputs_finite(out)
    return ok & above_floor(raw["log_alpha"], compute_dtype) if "log_alpha" in raw else ok

  raw = dict(q=q, **state)
  name = _scheme[0] or ("outputs" if impl in _FAST_IMPLS else "inputs")
  if name == "inputs":
    return slow(raw, extra, decide=True)
  if name == "none":
    return run(raw, extra)
  # (integer arrays, segment_ids, are closed over: they take no cotangent)
  floats = {
    n: x
    for n, x in extra.items()
    if x is not None and all(_is_float(leaf) for leaf in jax.tree.leaves(x))
  }
  ints = {n: x for n, x in extra.items() if n not in floats}

  def fast_f(raw, floats):
    return fast(raw, {**floats, **ints})

  def slow_f(raw, floats):
    return slow(raw, {**floats, **ints})

  @jax.custom_vjp
  def call(raw, floats):
    out = fast_f(raw, floats)
    return jax.lax.cond(fast_ok(raw, out), lambda: out, lambda: slow_f(raw, floats))

  def call_fwd(raw, floats):
    out, vjp = jax.vjp(fast_f, raw, floats)
    ok = fast_ok(raw, out)
    # (the fallback's primal as its VJP computes it: differentiated kernels may form the outputs
    # in other stages than undifferentiated ones, e.g. the Pallas delta rule's)
    out = jax.lax.cond(ok, lambda: out, lambda: jax.vjp(slow_f, raw, floats)[0])
    return out, (ok, vjp, raw, floats)

  def call_bwd(res, cts):
    ok, vjp, raw, floats = res
    return jax.lax.cond(ok, vjp, lambda c: jax.vjp(slow_f, raw, floats)[1](c), cts)

  call.defvjp(call_fwd, call_bwd)
  return call(raw, floats)


def _is_float(x):
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _outputs_finite(out):
  """A scalar bool: o and the final states are finite (states at positions are not read: the
  other outputs already show every non-finite input)."""
  o, memory, var, _ = out
  return _all_finite([x for x in (o, memory, var) if x is not None])
