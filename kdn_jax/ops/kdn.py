"""Kalman Delta Networks: the diagonal and isotropic gains feeding the
asymmetric delta rule (write kappa_t, erase k_t). docs/math.md sections 2-5."""

import functools

import jax
import jax.numpy as jnp

from kdn_jax.ops import dispatch, heads, nonfinite, states_at, variance, widths
from kdn_jax.ops import validation as val
from kdn_jax.ops.delta_reference import delta_step, scan_tokens
from kdn_jax.ops.delta_rule import DEFAULT_CHUNK, resolve, run_memory
from kdn_jax.ops.state import KDNState


def _check_kdn(op, diag, q, k, v, log_alpha, omega, r):
  b, t, h, kd, vd = val.check_qkv(op, q, k, v)
  val.check_float(op, "log_alpha", log_alpha)
  val.check_shape(op, "log_alpha", log_alpha, (b, t, h, kd), "[B, T, H, K]")
  val.check_float(op, "omega", omega)
  if diag:
    val.check_shape(op, "omega", omega, (b, t, h, kd), "[B, T, H, K]")
  else:
    val.check_shape(op, "omega", omega, (b, t, h), "[B, T, H]")
  val.check_float(op, "r", r)
  val.check_shape(op, "r", r, (b, t, h), "[B, T, H]")
  return b, t, h, kd, vd


def _initial_state(op, diag, state, b, h, kd, vd, dtype):
  var_shape = (b, h, kd) if diag else (b, h)
  if state is None:
    return KDNState(jnp.zeros((b, h, kd, vd), dtype), jnp.ones(var_shape, dtype))
  if not isinstance(state, KDNState):
    raise TypeError(
      f"{op}: initial_state must be a KDNState(memory, variance), got {type(state).__name__}"
    )
  val.check_float(op, "initial_state.memory", state.memory)
  val.check_shape(op, "initial_state.memory", state.memory, (b, h, kd, vd), "[B, H, K, V]")
  val.check_float(op, "initial_state.variance", state.variance)
  val.check_shape(
    op, "initial_state.variance", state.variance, var_shape, "[B, H, K]" if diag else "[B, H]"
  )
  return KDNState(state.memory.astype(dtype), state.variance.astype(dtype))


def _gain_step(diag, mu):
  """(variance, k, log_alpha, omega, r) -> (write direction, new variance)."""
  if diag:

    def step(p, k, la, om, r):
      kappa, _, p = variance.diag_variance_step(p, k, la, om, r, mu[:, None])
      return kappa, p
  else:

    def step(b, k, la, om, r):
      beta, _, b = variance.iso_variance_step(b, k, la, om, r, mu)
      return beta[..., None] * k, b

  return step


def _check_kdn_values(op, q, k, v, log_alpha, omega, r, mu, state, state_given):
  """Checked mode: the domain of the KDN inputs (docs/math.md section 2), every value
  finite except log_alpha, for which -inf (forget everything) is legal."""
  memory, variance = (state.memory, state.variance) if state_given else (None, None)
  val.check_values(
    op,
    (
      ("log_alpha", log_alpha, "<= 0"),
      ("omega", omega, ">= 0"),
      ("omega", omega, "finite"),
      ("r", r, "> 0"),
      ("r", r, "finite"),
      ("info_scale", mu, "> 0"),
      ("info_scale", mu, "finite"),
      ("initial_state.variance", variance, "> 0"),
      ("initial_state.variance", variance, "finite"),
      ("q", q, "finite"),
      ("k", k, "finite"),
      ("v", v, "finite"),
      ("initial_state.memory", memory, "finite"),
    ),
  )


def _kdn(
  op,
  diag,
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  info_scale,
  scale,
  initial_state,
  output_final_state,
  segment_ids,
  impl,
  chunk_size,
  checked,
  output_states_at,
  kernel_config=None,
):
  q, k = heads.to_value_heads(op, q, k, v)
  b, t, h, kd, vd = _check_kdn(op, diag, q, k, v, log_alpha, omega, r)
  val.check_segment_ids(op, segment_ids, b, t)
  positions = states_at.check_positions(op, output_states_at, t)
  impl, chunk_size = resolve(op, impl, kd, vd, chunk_size, b * t * h)
  out_dtype = q.dtype
  cd = val.compute_dtype(q, k, v, log_alpha, omega, r)
  input_dtype = jnp.result_type(q, k, v)
  mu = val.info_scale_array(op, info_scale, h, kd, cd)
  state0 = _initial_state(op, diag, initial_state, b, h, kd, vd, cd)
  if checked:
    _check_kdn_values(op, q, k, v, log_alpha, omega, r, mu, state0, initial_state is not None)
  scale = kd**-0.5 if scale is None else scale

  def body(inputs, extra):
    q, k, v, log_alpha, omega, r = (inputs[n] for n in ("q", "k", "v", "log_alpha", "omega", "r"))
    state0, mu, segment_ids = extra["state0"], extra["mu"], extra["segment_ids"]
    scale_ = extra.get("scale", scale)
    if impl != "pallas":
      # (The Pallas kernels read each input in its own dtype and compute in fp32 inside: fp32
      # copies of 16-bit [B, T, H, K] inputs would be whole extra passes over HBM, three
      # converts of 50 us each in an H200 profile of the T=4096 forward, docs/decisions.md.)
      q, k, v, log_alpha, omega, r = (x.astype(cd) for x in (q, k, v, log_alpha, omega, r))
    at = ()
    if impl == "reference":
      starts = None if segment_ids is None else variance.segment_starts(segment_ids)
      o, (memory, var), *every = _kdn_reference(
        diag,
        q * scale_,
        k,
        v,
        log_alpha,
        omega,
        r,
        mu,
        tuple(state0),
        starts,
        positions is not None,
      )
      if positions is not None:
        at = (KDNState(*(states_at.gather_tokens(x, positions) for x in every[0])),)
    else:
      write, var, *var_at = _gain(
        op,
        diag,
        impl,
        k,
        log_alpha,
        omega,
        r,
        mu,
        state0.variance,
        segment_ids,
        input_dtype,
        positions,
        kernel_config,
      )
      o, memory, *mem_at = run_memory(
        op,
        impl,
        q,
        k,
        v,
        log_alpha,
        write,
        state0.memory,
        segment_ids,
        chunk_size,
        input_dtype,
        scale_,
        positions,
        kernel_config,
      )
      if positions is not None:
        at = (KDNState(mem_at[0], var_at[0]),)
    return o.astype(out_dtype), memory, var, at

  extra = dict(state0=state0, mu=mu, segment_ids=segment_ids)
  if isinstance(scale, jax.Array):
    extra["scale"] = scale  # (traced: differentiable, so an argument of the guard's VJP)
  o, memory, var, at = nonfinite.guarded(
    body,
    impl,
    q,
    dict(k=k, v=v, log_alpha=log_alpha, omega=omega, r=r),
    extra,
    cd,
    variance=("k", "log_alpha", "omega", "r"),
    r_names=("r",),
  )
  final = KDNState(memory, var) if output_final_state else None
  return (o, final) + at


def _variance_at(diag, positions, k, log_alpha, omega, r, mu, var0, segment_ids):
  """The variance after each position [B, P, H(, K)] for the Pallas path: the
  posteriors of the XLA Moebius scan (variance.py), an elementwise pass over
  [B, T, H, K], 1/V of the memory pass's work (the gain kernels keep their
  chunk carries inside, and their backward takes no cotangent for them)."""
  k, log_alpha, omega, r = (x.astype(var0.dtype) for x in (k, log_alpha, omega, r))
  scan = variance.diag_variance_scan if diag else variance.iso_variance_scan
  _, post = scan(k, log_alpha, omega, r, mu, var0, segment_ids)
  return states_at.gather_tokens(post, positions)


@functools.partial(jax.jit, static_argnums=(0, 10))
def _kdn_reference(diag, q, k, v, log_alpha, omega, r, mu, state0, starts, keep_states=False):
  """Token-by-token KDN: the gain step feeds the delta step. Returns
  (o, final (memory, variance)), and with keep_states also (memory, variance)
  after every token ([B, T, H, K, V], [B, T, H(, K)])."""
  gain_step = _gain_step(diag, mu)

  def step(carry, x):
    memory, var = carry
    qt, kt, vt, lat, omt, rt = x
    write, var = gain_step(var, kt, lat, omt, rt)
    o, memory = delta_step(memory, qt, kt, vt, lat, write)
    return (memory, var), ((o, (memory, var)) if keep_states else o)

  carry, ys = scan_tokens(step, state0, (q, k, v, log_alpha, omega, r), starts)
  return (ys[0], carry, ys[1]) if keep_states else (ys, carry)


def _gain(
  op,
  diag,
  impl,
  k,
  log_alpha,
  omega,
  r,
  mu,
  var0,
  segment_ids,
  input_dtype,
  positions=None,
  kernel_config=None,
):
  """The delta rule's write for all tokens (diag: kappa [B, T, H, K]; iso:
  beta [B, T, H], write = beta k) and the final variance (with positions, also
  the variance after each). input_dtype (the caller's q/k/v dtype): the Pallas
  diag gain stores kappa as the delta rule wants it for that data
  (pallas_kernels.write_dtype)."""
  kernels = dispatch.pallas_module() if impl == "pallas" else None
  if not kernels:
    fn = variance.diag_gain if diag else variance.iso_gain  # iso: beta, write = beta k
    return fn(
      k,
      log_alpha,
      omega,
      r,
      mu,
      var0,
      segment_ids,
      at=None if positions is None else tuple(int(p) for p in positions),
    )
  # (widths the kernels do not take are padded onto theirs: widths.py)
  gain_config = dispatch.family_config(kernel_config, "gain")
  if diag:
    out = widths.diag_gain(
      kernels,
      k,
      log_alpha,
      omega,
      r,
      mu,
      var0,
      segment_ids,
      gain_dtype=kernels.write_dtype(input_dtype),
      config=gain_config,
    )
  else:
    out = widths.iso_gain(
      kernels, k, log_alpha, omega, r, mu, var0, segment_ids, config=gain_config
    )
  if positions is None:
    return out
  return out + (_variance_at(diag, positions, k, log_alpha, omega, r, mu, var0, segment_ids),)


def diag_kdn(
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  *,
  info_scale=None,
  scale=None,
  initial_state=None,
  output_final_state=False,
  segment_ids=None,
  impl="auto",
  chunk_size=DEFAULT_CHUNK,
  checked=False,
  output_states_at=None,
  kernel_config=None,
):
  """Diagonal Kalman Delta Network.

  Args:
    q, k: [B, T, H_k, K]; v: [B, T, H, V]; log_alpha, omega: [B, T, H, K]
      (omega >= 0, log_alpha <= 0); r: [B, T, H] observation noise (> 0).
      H is a multiple of H_k (grouped value heads: value head j reads q/k head
      j // (H / H_k); heads.py): the gain inputs, the output and the state
      have the H value heads.
    info_scale: mu > 0, a float or an [H] array; default K.
    scale: query scale, default K ** -0.5.
    initial_state: KDNState(memory [B,H,K,V], variance [B,H,K]) or None
      (memory 0, variance 1).
    output_final_state: also return the final KDNState.
    segment_ids: [B, T] ints for packed sequences (each segment starts from
      the initial state), or None.
    impl: 'auto', 'reference', 'chunked' or 'pallas'.
    chunk_size: memory chunk length for 'chunked' / 'pallas' (None: per
      platform, see `delta_rule.default_chunk_size`).
    checked: check the values (log_alpha <= 0, -inf allowed; omega >= 0,
      r > 0, mu > 0, initial variance > 0, all finite; q, k, v and the
      initial memory finite) and raise `ops.InvalidValueError` naming the
      argument; under jit wrap the caller in `ops.checked`.
    output_states_at: None, or positions [P] (ints known when tracing, sorted,
      in [1, T]): also return the state after each position p (the final
      state of the op on the first p tokens; kdn_jax.ops.states_at);
      differentiable.
    kernel_config: the Pallas kernels' configs (pallas_kernels.KernelConfigs, its delta_rule
      and gain members), or None: the tuned ones (as in `delta_rule`).

  Returns:
    (o [B, T, H, V] in the input dtype, KDNState or None), and with
    output_states_at a third entry: KDNState(memory [B, P, H, K, V],
    variance [B, P, H, K] (iso: [B, P, H])).
  """
  return _kdn(
    "diag_kdn",
    True,
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    info_scale,
    scale,
    initial_state,
    output_final_state,
    segment_ids,
    impl,
    chunk_size,
    checked,
    output_states_at,
    kernel_config,
  )


def iso_kdn(
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  *,
  info_scale=None,
  scale=None,
  initial_state=None,
  output_final_state=False,
  segment_ids=None,
  impl="auto",
  chunk_size=DEFAULT_CHUNK,
  checked=False,
  output_states_at=None,
  kernel_config=None,
):
  """Isotropic Kalman Delta Network: like `diag_kdn` with omega [B, T, H]
  and a per-head scalar variance (KDNState.variance [B, H])."""
  return _kdn(
    "iso_kdn",
    False,
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    info_scale,
    scale,
    initial_state,
    output_final_state,
    segment_ids,
    impl,
    chunk_size,
    checked,
    output_states_at,
    kernel_config,
  )


def _kdn_step(
  op, diag, q, k, v, log_alpha, omega, r, state, info_scale, scale, checked, impl, kernel_config
):
  if not isinstance(state, KDNState):
    raise TypeError(f"{op}: state must be a KDNState, got {type(state).__name__}")
  q, k = heads.to_value_heads(op, q, k, v, axis=1)
  # Reuse the sequence checks with T = 1.
  add_t = lambda x: jnp.expand_dims(x, 1)
  b, _, h, kd, vd = _check_kdn(op, diag, *map(add_t, (q, k, v, log_alpha, omega, r)))
  out_dtype = q.dtype
  cd = val.compute_dtype(q, k, v, log_alpha, omega, r)
  mu = val.info_scale_array(op, info_scale, h, kd, cd)
  state = _initial_state(op, diag, state, b, h, kd, vd, cd)
  if checked:
    _check_kdn_values(op, q, k, v, log_alpha, omega, r, mu, state, True)
  scale = kd**-0.5 if scale is None else scale
  if dispatch.resolve_step_impl(op, impl, kd, vd) == "pallas":
    # (the fused step reads each input in its own dtype and computes in fp32)
    o, memory, var = dispatch.pallas_module().decode.kdn_step(
      q,
      k,
      v,
      log_alpha,
      omega,
      r,
      mu,
      state.memory,
      state.variance,
      scale,
      diag=diag,
      config=dispatch.family_config(kernel_config, "decode"),
    )
    return o, KDNState(memory.astype(cd), var.astype(cd))
  q, k, v, log_alpha, omega, r = (x.astype(cd) for x in (q, k, v, log_alpha, omega, r))
  write, var = _gain_step(diag, mu)(state.variance, k, log_alpha, omega, r)
  o, memory = delta_step(state.memory, q * scale, k, v, log_alpha, write)
  return o.astype(out_dtype), KDNState(memory, var)


def diag_kdn_step(
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  state,
  *,
  info_scale=None,
  scale=None,
  checked=False,
  impl="auto",
  kernel_config=None,
):
  """One decode token of diag_kdn.

  q, k: [B, H_k, K]; log_alpha, omega: [B, H, K]; v: [B, H, V]; r: [B, H];
  state: KDNState (grouped value heads as in `diag_kdn`).
  impl: 'pallas' runs the fused decode step (pallas_kernels.decode: gain,
  decay, erase / write and read in one pass over the state, forward only);
  'reference' (or 'chunked') the XLA step; 'auto': see
  dispatch.resolve_step_impl.
  Returns (o_t [B, H, V], new KDNState).
  """
  return _kdn_step(
    "diag_kdn_step",
    True,
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    state,
    info_scale,
    scale,
    checked,
    impl,
    kernel_config,
  )


def iso_kdn_step(
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  state,
  *,
  info_scale=None,
  scale=None,
  checked=False,
  impl="auto",
  kernel_config=None,
):
  """One decode token of iso_kdn (omega, r: [B, H]; variance [B, H])."""
  return _kdn_step(
    "iso_kdn_step",
    False,
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    state,
    info_scale,
    scale,
    checked,
    impl,
    kernel_config,
  )
