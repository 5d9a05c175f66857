"""Input checks shared by the public ops. They run while tracing, so bad
input fails before XLA compiles anything, with the argument named."""

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "reference", "chunked", "pallas")


def check_impl(op, impl):
  if impl not in IMPLS:
    raise ValueError(f"{op}: impl={impl!r} is not one of {', '.join(IMPLS)}")


def check_float(op, name, x):
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{op}: {name} must be a floating array (float32, bfloat16 or float64), got dtype {dtype}"
    )


def check_shape(op, name, x, expected, meaning):
  """expected: tuple of ints; meaning: e.g. '[B, T, H, K]'."""
  shape = tuple(jnp.shape(x))
  if shape != tuple(expected):
    raise ValueError(f"{op}: {name} must have shape {meaning} = {tuple(expected)}, got {shape}")


def check_rank(op, name, x, rank, meaning):
  if jnp.ndim(x) != rank:
    raise ValueError(
      f"{op}: {name} must have rank {rank} {meaning}, got shape {tuple(jnp.shape(x))}"
    )


def check_qkv(op, q, k, v):
  """Checks q, k [B,T,H,K] and v [B,T,H,V]; returns (B, T, H, K, V)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_rank(op, name, x, 4, "[B, T, H, K]" if name != "v" else "[B, T, H, V]")
    check_float(op, name, x)
  b, t, h, kd = q.shape
  check_shape(op, "k", k, q.shape, "[B, T, H, K] like q")
  if v.shape[:3] != (b, t, h):
    raise ValueError(
      f"{op}: v must have shape [B, T, H, V] with B, T, H = "
      f"{(b, t, h)} from q, got {tuple(v.shape)}"
    )
  if t < 1:
    raise ValueError(f"{op}: the sequence length T must be >= 1, got {t}")
  return b, t, h, kd, v.shape[3]


def check_decay(op, name, log_alpha, b, t, h, kd):
  check_float(op, name, log_alpha)
  if log_alpha.shape not in ((b, t, h, kd), (b, t, h)):
    raise ValueError(
      f"{op}: {name} must have shape [B, T, H, K] = "
      f"{(b, t, h, kd)} or [B, T, H] = {(b, t, h)}, got "
      f"{tuple(log_alpha.shape)}"
    )


def check_segment_ids(op, segment_ids, b, t):
  if segment_ids is None:
    return
  if tuple(jnp.shape(segment_ids)) != (b, t):
    raise ValueError(
      f"{op}: segment_ids must have shape [B, T] = {(b, t)}, got {tuple(jnp.shape(segment_ids))}"
    )
  if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
    raise TypeError(f"{op}: segment_ids must be integers, got dtype {jnp.result_type(segment_ids)}")


def check_chunk_size(op, chunk_size):
  if (
    not isinstance(chunk_size, (int, np.integer))
    or chunk_size < 1
    or (chunk_size > 16 and chunk_size % 16)
  ):
    raise ValueError(
      f"{op}: chunk_size must be a positive int, <= 16 or a multiple of 16, got {chunk_size!r}"
    )


def info_scale_array(op, info_scale, h, kd, dtype):
  """mu as a [H] array; default K. Concrete values must be > 0."""
  if info_scale is None:
    info_scale = float(kd)
  if not isinstance(info_scale, jax.core.Tracer):
    arr = np.asarray(info_scale)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != h):
      raise ValueError(
        f"{op}: info_scale must be a float or an array of shape [H] = ({h},), got shape {arr.shape}"
      )
    if not np.issubdtype(arr.dtype, np.number) or not np.all(arr > 0):
      raise ValueError(f"{op}: info_scale (mu) must be > 0, got {info_scale}")
  elif jnp.ndim(info_scale) > 1 or (jnp.ndim(info_scale) == 1 and jnp.shape(info_scale)[0] != h):
    raise ValueError(
      f"{op}: info_scale must be a float or an array of shape "
      f"[H] = ({h},), got shape {jnp.shape(info_scale)}"
    )
  return jnp.broadcast_to(jnp.asarray(info_scale, dtype), (h,))


def compute_dtype(*arrays):
  """float64 if any input is float64 (x64 on), else float32."""
  if any(jnp.result_type(a) == jnp.float64 for a in arrays if a is not None):
    return jnp.float64
  return jnp.float32


class InvalidValueError(ValueError):
  """A value outside an op's documented domain (checked mode: `checked=True`)."""


# rule -> the elementwise test a valid value passes (NaN passes none of them;
# "<= 0" lets log_alpha = -inf, a full forget, through).
_VALUE_RULES = {
  "> 0": lambda x: x > 0,
  ">= 0": lambda x: x >= 0,
  "<= 0": lambda x: x <= 0,
  "finite": jnp.isfinite,
}
_CHECK_SUFFIX = " (`check` failed)"


def check_values(op, checks):
  """Checked mode: every (name, array, rule) in checks must hold elementwise.

  rule is one of '> 0', '>= 0', '<= 0', 'finite' (the first rule that fails
  is named). Concrete arrays are checked now and
  raise InvalidValueError; traced ones (under jit / grad / vmap) become
  `checkify.check`s, which `kdn_jax.ops.checked` (or checkify.checkify)
  turns into the same error. Opt-in: a check is a device-to-host sync (or,
  traced, an extra output), which a training step should not pay.
  """
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top

  for name, x, rule in checks:
    if x is None:
      continue
    ok = _VALUE_RULES[rule](x)
    msg = f"{op}: {name} must be {rule}"
    if not isinstance(x, jax.core.Tracer):
      ok = np.asarray(ok)
      if not ok.all():
        first = np.asarray(x).ravel()[np.argmin(ok.ravel())]
        raise InvalidValueError(f"{msg}; got {int((~ok).sum())} bad value(s), first {first}")
      continue
    bad = ~ok
    checkify.check(
      ~jnp.any(bad),
      msg + "; got {n} bad value(s), first {first}",
      n=jnp.sum(bad),
      first=jnp.ravel(x)[jnp.argmax(jnp.ravel(bad))],
    )


def checked(fn):
  """fn with the value checks of the ops it calls (`checked=True`) made
  usable under jit: returns a function that runs fn through
  `jax.experimental.checkify` and raises InvalidValueError naming the op and
  the argument of the first bad value. fn may be jitted itself; call the
  result outside jit.
  """
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top

  functionalized = checkify.checkify(fn, errors=checkify.user_checks)

  def run(*args, **kwargs):
    err, out = functionalized(*args, **kwargs)
    msg = err.get()
    if msg is not None:
      raise InvalidValueError(msg.removesuffix(_CHECK_SUFFIX))
    return out

  return run
