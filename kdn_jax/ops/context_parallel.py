"""Context parallelism: one sequence's T split over a mesh axis.

Each device holds a contiguous slice of T. Both recurrences are chained
across slices by small per-slice maps (docs/math.md section 4 and section 1):

- Variance (KDN gain): the slice's per-channel 2x2 Moebius product (a segment
  start inside the slice folds in the reset, making it a constant map). The
  products are all-gathered over the axis ([n, B, H(, K)] x 4 numbers) and
  composed in slice order from the user's initial variance, which gives each
  slice its incoming variance p_in. The local gain then runs from p_in with
  segment starts resetting to the user's p0 (chunked: variance.py's chunk
  schedule with the two values apart; Pallas: the gain kernels reset to the
  variance they start from, so with segment_ids a second kernel run from p0
  supplies the tokens after the slice's first segment start).
- Memory: S ↦ (I - w k^T) D S + w v^T is affine in S, column by column, so one
  local run on the augmented state [S_V | Phi] (values [v, 0], initial state
  [S_V0, I]) gives the slice's zero-start final state c (first V columns) and
  its K x K transition Phi (last K columns): S_end = M S_in + c with M = Phi
  (M = 0 when the slice holds a segment start, since the reset forgets S_in).
  The (M, c) are all-gathered and composed in slice order from the user's
  initial state, giving S_in. The same run's K extra output columns
  o_K,t = scale Phi_t^T q_t correct the outputs: o_t = o_V,t + o_K,t (S_in -
  S_V0) for tokens before the slice's first segment start (after it the state
  restarted from the user's initial state, already in o_V).

  "Correct" rather than "recompute" (a second local run from S_in): one local
  memory run instead of two, and a recompute from S_in would also be wrong
  with segments (the local op would reset the later segments to S_in, not to
  the user's initial state).

Only per-slice maps cross devices (never the sequence), and gradients are
exact by autodiff: all_gather transposes to a reduce-scatter, psum to a
broadcast. The final state is the last slice's, made the same on every device
with a masked psum.

`diag_kdn`, `iso_kdn`, `delta_rule`, `kda`, ... here take local slices and an
`axis_name` and run inside `shard_map`; context_sharding.py wraps them in
`shard_map` for use under `jit` with arrays sharded along T, and picks them for
the layers.
"""

import jax
import jax.numpy as jnp

from kdn_jax.ops import dispatch, heads, mobius, variance
from kdn_jax.ops import kdn as kdn_ops
from kdn_jax.ops import validation as val
from kdn_jax.ops.delta_rule import (
  beta_times,
  beta_write,
  check_args,
  default_chunk_size,
  run_memory,
)

# kdn.py's gain dispatch (its checks and defaults come through kdn.prepare, so both forms of the
# op accept and refuse the same inputs)
from kdn_jax.ops.kdn import _gain
from kdn_jax.ops.state import KDNState


class _Boundaries:
  """Where segments start in this slice, seen globally.

  start: [B, Tl] bool, True where a new segment begins, including at the
    slice's first token when it continues no segment of the previous slice
    (the local ops never see that one: they start from their initial state).
  head: [B, Tl] bool, True before the slice's first start (these tokens
    carry the state coming in from the previous slice).
  has_start: [B] bool.
  """

  def __init__(self, axis_name, segment_ids):
    idx = jax.lax.axis_index(axis_name)
    last = jax.lax.all_gather(segment_ids[:, -1], axis_name)  # [n, B]
    prev_last = jnp.where(idx > 0, last[jnp.maximum(idx - 1, 0)], segment_ids[:, 0])
    prev = jnp.concatenate([prev_last[:, None], segment_ids[:, :-1]], axis=1)
    self.start = segment_ids != prev
    self.head = jnp.cumsum(self.start.astype(jnp.int32), axis=1) == 0
    self.has_start = jnp.any(self.start, axis=1)


def _slice_index_and_size(axis_name):
  return jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)


def _exclusive_chain(axis_name, local_map, apply_map, start):
  """The value entering this device's slice.

  local_map: this slice's map (a pytree); apply_map(map, x) -> x. The maps of
  all slices are all-gathered (they are small) and applied in slice order
  from `start`, on every device; each device keeps the value entering its
  own slice.
  """
  idx, n = _slice_index_and_size(axis_name)
  maps = jax.lax.all_gather(local_map, axis_name)  # leading axis: slice
  x, incoming = start, []
  for d in range(n):
    incoming.append(x)
    x = apply_map(jax.tree.map(lambda m, d=d: m[d], maps), x)
  return jnp.stack(incoming)[idx]


def _last_slice(axis_name, x):
  """x of the last slice, the same on every device (a masked psum)."""
  idx, n = _slice_index_and_size(axis_name)
  return jax.lax.psum(jnp.where(idx == n - 1, x, jnp.zeros_like(x)), axis_name)


def _token_mobius(diag, k, log_alpha, omega, r, mu, p0, start):
  """The token maps (a, b, c, d) of the variance, resets folded in."""
  if diag:
    decay2, u = variance.diag_gain_terms(k, log_alpha, r, mu[:, None])
  else:
    decay2, u = variance.iso_gain_terms(k, log_alpha, r, mu)
  a, b, c, d = decay2, omega, u * decay2, 1.0 + u * omega
  if start is not None:
    # A reset sets the variance to p0 before the token: compose the token map
    # with the constant map x -> p0 = [[0, p0], [0, 1]] (as variance.py does).
    st = start.reshape(start.shape + (1,) * (a.ndim - 2))
    p0b = p0[:, None]
    zero = jnp.zeros_like(a)
    a, b, c, d = (
      jnp.where(st, zero, a),
      jnp.where(st, a * p0b + b, b),
      jnp.where(st, zero, c),
      jnp.where(st, c * p0b + d, d),
    )
  return a, b, c, d


def _reduce_mobius(m):
  """The composition M_T o ... o M_1 over axis 1, by pairwise halving
  (O(T) work, log T depth, no per-token prefixes kept)."""
  while m[0].shape[1] > 1:
    if m[0].shape[1] % 2:
      ident = (1.0, 0.0, 0.0, 1.0)
      m = tuple(jnp.concatenate([x, jnp.full_like(x[:, :1], e)], axis=1) for x, e in zip(m, ident))
    m = mobius.compose(tuple(x[:, 0::2] for x in m), tuple(x[:, 1::2] for x in m))
  return tuple(x[:, 0] for x in m)


def _xla_gain_from(diag, m, k, log_alpha, omega, r, p_in, p0, start):
  """The chunked XLA gain of variance.py, but entering the slice with p_in
  while segment starts reset to p0 (variance.diag_gain uses one value for
  both). m: the token maps with the resets folded in."""
  post = variance._chunked_posteriors(m, p_in, variance.GAIN_CHUNK)  # pylint: disable=protected-access
  prev = jnp.concatenate([p_in[:, None], post[:, :-1]], axis=1)
  if start is not None:
    st = start.reshape(start.shape + (1,) * (prev.ndim - 2))
    prev = jnp.where(st, p0[:, None], prev)
  decay2 = jnp.exp(2.0 * log_alpha) if diag else jnp.mean(jnp.exp(2.0 * log_alpha), axis=-1)
  prior = decay2 * prev + omega
  if diag:
    write = prior * k / (r + jnp.sum(prior * k * k, axis=-1))[..., None]
  else:
    write = (prior / (r + prior * jnp.sum(k * k, axis=-1)))[..., None] * k
  return write, post[:, -1]


def _gain_cp(
  axis_name,
  op,
  diag,
  impl,
  k,
  log_alpha,
  omega,
  r,
  mu,
  p0,
  segment_ids,
  bounds,
  input_dtype,
  k_caller,
  kernel_config=None,
):
  """The writes of this slice (diag: kappa [B, T, H, K]; iso: beta k, or on
  the pallas path beta [B, T, H] itself) and the global final variance.
  k_caller: k as the caller gave it, which the Pallas gain reads (as in the
  unsplit op: it picks its math from k's dtype, pallas_kernels/kernel_math.py)."""
  start = None if bounds is None else bounds.start
  m = _token_mobius(diag, k, log_alpha, omega, r, mu, p0, start)
  p_in = _exclusive_chain(axis_name, _reduce_mobius(m), mobius.apply, p0)
  if impl != "pallas":
    write, p_end = _xla_gain_from(diag, m, k, log_alpha, omega, r, p_in, p0, start)
    return write, _last_slice(axis_name, p_end)

  def gain_from(var0):
    return _gain(
      op,
      diag,
      impl,
      k_caller,
      log_alpha,
      omega,
      r,
      mu,
      var0,
      segment_ids,
      input_dtype,
      kernel_config=kernel_config,
    )

  write, p_end = gain_from(p_in)
  if bounds is not None:
    # The kernels reset segments to the variance they start from: after the
    # slice's first start that must be p0, not p_in, so those tokens come
    # from a second run from p0.
    write_p0, p_end_p0 = gain_from(p0)
    # (write: [B, T, H, K], or the iso gain's beta [B, T, H])
    head = bounds.head.reshape(bounds.head.shape + (1,) * (write.ndim - 2))
    write = jnp.where(head, write, write_p0)
    has = bounds.has_start.reshape((-1,) + (1,) * (p_end.ndim - 1))
    p_end = jnp.where(has, p_end_p0, p_end)
  return write, _last_slice(axis_name, p_end)


def _affine_apply(m_c, s):
  m, c = m_c
  return jnp.einsum("bhkj,bhjv->bhkv", m, s, precision=jax.lax.Precision.HIGHEST) + c


def _memory_cp(
  axis_name,
  op,
  impl,
  q,
  k,
  v,
  log_alpha,
  write,
  memory0,
  segment_ids,
  bounds,
  chunk_size,
  input_dtype,
  scale,
  kernel_config=None,
):
  """Outputs of this slice and the global final memory."""
  if bounds is None:
    memory_v0 = jnp.zeros_like(memory0)
  else:
    # A slice with a segment start needs the user's initial state as the
    # reset value; one without runs from zero (its c is then the zero-start
    # final state directly).
    memory_v0 = jnp.where(bounds.has_start[:, None, None, None], memory0, jnp.zeros_like(memory0))
  # The local memory run on [S_V | Phi] from [memory_v0, I] (values [v, 0]): o_V [B, Tl, H, V],
  # o_K [B, Tl, H, K], final S_V [B, H, K, V] and Phi [B, H, K, K]. (On the Pallas path, V + K
  # columns wider than the kernels take run as column tiles: widths.py.)
  b, _, h, kd = k.shape
  vd = v.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(kd, dtype=memory_v0.dtype), (b, h, kd, kd))
  zeros = jnp.zeros(v.shape[:3] + (kd,), v.dtype)
  o, s = run_memory(
    op,
    impl,
    q,
    k,
    jnp.concatenate([v, zeros], axis=-1),
    log_alpha,
    write,
    jnp.concatenate([memory_v0, eye.astype(memory_v0.dtype)], axis=-1),
    segment_ids,
    chunk_size,
    input_dtype,
    scale,
    kernel_config=kernel_config,
  )
  o_v, o_k, s_v, phi = o[..., :vd], o[..., vd:], s[..., :vd], s[..., vd:]
  phi = phi.astype(s_v.dtype)
  if bounds is not None:
    phi = jnp.where(bounds.has_start[:, None, None, None], 0.0, phi)
  local = (phi, s_v)
  s_in = _exclusive_chain(axis_name, local, _affine_apply, memory0)
  # Outputs of tokens that carry the incoming state: o_K maps a change of
  # the slice's initial state to a change of the output.
  correction = jnp.einsum(
    "bthk,bhkv->bthv", o_k.astype(s_in.dtype), s_in - memory_v0, precision=jax.lax.Precision.HIGHEST
  )
  if bounds is not None:
    correction = correction * bounds.head[..., None, None]
  o = o_v.astype(correction.dtype) + correction
  s_end = _affine_apply(local, s_in)
  return o, _last_slice(axis_name, s_end)


def _check_axis(op, axis_name):
  try:
    jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
      f"{op}: axis_name={axis_name!r} is not a mesh axis of "
      "the enclosing shard_map (call it inside shard_map, or "
      "use context_sharded under jit)"
    ) from e


def _local_impl(op, impl, chunk_size):
  """(impl, chunk_size) of the local slices: 'reference' has no context-parallel form."""
  impl = dispatch.resolve_impl(op, impl)
  if impl == "reference":
    raise ValueError(
      f"{op}: impl='reference' has no context-parallel form; use 'chunked' or 'pallas'"
    )
  chunk_size = default_chunk_size(impl) if chunk_size is None else chunk_size
  val.check_chunk_size(op, chunk_size)
  return impl, chunk_size


def _kdn_op(name, diag, doc):
  """The context-parallel form of the KDN op `name` (diag: per-channel gain, else per-head)."""
  op = f"context_parallel.{name}"

  def kdn_op(
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    *,
    axis_name,
    info_scale=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    impl="auto",
    chunk_size=None,
    kernel_config=None,
  ):
    _check_axis(op, axis_name)
    arrays = (q, k, v, log_alpha, omega, r)
    choose = lambda *_: _local_impl(op, impl, chunk_size)
    p = kdn_ops.prepare(op, diag, arrays, info_scale, scale, initial_state, segment_ids, choose)
    q, k, v, log_alpha, omega, r = p.cast()
    bounds = None if segment_ids is None else _Boundaries(axis_name, segment_ids)
    write, var = _gain_cp(
      axis_name,
      op,
      diag,
      p.impl,
      k,
      log_alpha,
      omega,
      r,
      p.mu,
      p.state0.variance,
      segment_ids,
      bounds,
      p.input_dtype,
      p.k,
      kernel_config,
    )
    o, memory = _memory_cp(
      axis_name,
      op,
      p.impl,
      q,
      k,
      v,
      log_alpha,
      write,
      p.state0.memory,
      segment_ids,
      bounds,
      p.chunk_size,
      p.input_dtype,
      p.scale,
      kernel_config,
    )
    final = KDNState(memory, var) if output_final_state else None
    return o.astype(p.out_dtype), final

  return kdn_ops.named(kdn_op, name, doc)


diag_kdn = _kdn_op(
  "diag_kdn",
  True,
  """`ops.diag_kdn` on this device's slice of T, inside `shard_map`.

q, k, v, log_alpha, omega, r, segment_ids: the local slices ([B, T/n, ...])
of arrays split along T over the mesh axis `axis_name` in device order.
initial_state: the sequence's KDNState (the same on every device of the
axis). Returns (o of the slice, the sequence's final KDNState, the same on
every device, or None). Other arguments as `ops.diag_kdn` ('chunked' or
'pallas'; the Pallas path needs shard_map(check_vma=False)).
""",
)

iso_kdn = _kdn_op(
  "iso_kdn",
  False,
  """`ops.iso_kdn` on this device's slice of T, inside `shard_map` (see
`diag_kdn`; omega, r [B, T/n, H], variance [B, H]).""",
)


def delta_rule(
  q,
  k,
  v,
  log_alpha,
  write,
  *,
  axis_name,
  scale=None,
  initial_state=None,
  output_final_state=False,
  segment_ids=None,
  impl="auto",
  chunk_size=None,
  kernel_config=None,
):
  """`ops.delta_rule` on this device's slice of T, inside `shard_map`.

  Local slices as in `diag_kdn`; initial_state: the sequence's memory
  [B, H, K, V] or None. Returns (o of the slice, final memory or None).
  """
  op = "context_parallel.delta_rule"
  _check_axis(op, axis_name)
  q, k = heads.to_value_heads(op, q, k, v)
  (_, _, _, kd, _), cd, memory0 = check_args(
    op, q, k, v, log_alpha, write, initial_state, segment_ids
  )
  impl, chunk_size = _local_impl(op, impl, chunk_size)
  scale = kd**-0.5 if scale is None else scale
  bounds = None if segment_ids is None else _Boundaries(axis_name, segment_ids)
  if impl != "pallas":  # (the Pallas kernels read them in their own dtypes)
    log_alpha, write = log_alpha.astype(cd), write.astype(cd)
  o, memory = _memory_cp(
    axis_name,
    op,
    impl,
    q.astype(cd),
    k.astype(cd),
    v.astype(cd),
    log_alpha,
    write,
    memory0,
    segment_ids,
    bounds,
    chunk_size,
    jnp.result_type(q, k, v),
    scale,
    kernel_config,
  )
  return o.astype(q.dtype), (memory if output_final_state else None)


def kda(q, k, v, g, beta, **kwargs):
  """`ops.kda` inside shard_map (per-channel decay g, write beta * k)."""
  q, k = heads.to_value_heads("context_parallel.kda", q, k, v)
  return delta_rule(q, k, v, g, beta_write(beta, k), **kwargs)


def gated_delta_rule(q, k, v, g, beta, **kwargs):
  """`ops.gated_delta_rule` inside shard_map (scalar decay g [B, T, H])."""
  q, k = heads.to_value_heads("context_parallel.gated_delta_rule", q, k, v)
  return delta_rule(q, k, v, g, beta_write(beta, k), **kwargs)


def delta_net(q, k, v, beta, **kwargs):
  """`ops.delta_net` inside shard_map (no decay)."""
  q, k = heads.to_value_heads("context_parallel.delta_net", q, k, v)
  return delta_rule(q, k, v, jnp.zeros(q.shape[:3], q.dtype), beta_write(beta, k), **kwargs)


def gdn2(q, k, v, g, b, w, **kwargs):
  """`ops.gdn2` inside shard_map (read/erase key b*k, write k, value w*v)."""
  q, k = heads.to_value_heads("context_parallel.gdn2", q, k, v)
  return delta_rule(q, beta_times(b, k), beta_times(w, v), g, k, **kwargs)


def gla(q, k, v, g, **kwargs):
  """`ops.gla` inside shard_map (no erase)."""
  q, k = heads.to_value_heads("context_parallel.gla", q, k, v)
  return delta_rule(q, jnp.zeros_like(k), v, g, k, **kwargs)


OPS = {
  "diag_kdn": diag_kdn,
  "iso_kdn": iso_kdn,
  "delta_rule": delta_rule,
  "kda": kda,
  "gated_delta_rule": gated_delta_rule,
  "delta_net": delta_net,
  "gdn2": gdn2,
  "gla": gla,
}


__all__ = [
  "OPS",
  "delta_net",
  "delta_rule",
  "diag_kdn",
  "gated_delta_rule",
  "gdn2",
  "gla",
  "iso_kdn",
  "kda",
]
