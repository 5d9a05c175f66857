"""Kalman Delta Networks: the diagonal and isotropic gains feeding the
asymmetric delta rule (write kappa_t, erase k_t). docs/math.md sections 2-5."""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A KDN op's inputs after the checks every form of the op shares (the sequence op here and
  its context-parallel form): the gain inputs with the H value heads, in the caller's dtypes."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  log_alpha: jax.Array
  omega: jax.Array
  r: jax.Array
  impl: str
  chunk_size: int
  positions: object  # checked output_states_at, or None
  cd: object  # compute dtype
  input_dtype: object  # q/k/v's result type: the Pallas dot precision and write dtype
  out_dtype: object
  mu: jax.Array  # info_scale as [H] in cd
  state0: KDNState  # in cd
  scale: object

  def inputs(self):
    return self.q, self.k, self.v, self.log_alpha, self.omega, self.r

  def cast(self):
    """The inputs in the compute dtype."""
    return tuple(x.astype(self.cd) for x in self.inputs())


def prepare(
  op,
  diag,
  arrays,
  info_scale,
  scale,
  initial_state,
  segment_ids,
  choose_impl,
  output_states_at=None,
):
  """Checks a KDN op's arguments, naming the bad one, and fills in the defaults.

  arrays: (q, k, v, log_alpha, omega, r) as the caller gave them.

  choose_impl(K, V, B*T*H) -> (impl, chunk_size): the form's own choice (the sequence op's
  dispatch, or the context-parallel slices', which have no reference form)."""
  q, k, v, log_alpha, omega, r = arrays
  q, k = heads.to_value_heads(op, q, k, v)
  b, t, h, kd, vd = _check_kdn(op, diag, q, k, v, log_alpha, omega, r)
  val.check_segment_ids(op, segment_ids, b, t)
  positions = states_at.check_positions(op, output_states_at, t)
  impl, chunk_size = choose_impl(kd, vd, b * t * h)
  cd = val.compute_dtype(q, k, v, log_alpha, omega, r)
  return Prepared(
    q,
    k,
    v,
    log_alpha,
    omega,
    r,
    impl=impl,
    chunk_size=chunk_size,
    positions=positions,
    cd=cd,
    input_dtype=jnp.result_type(q, k, v),
    out_dtype=q.dtype,
    mu=val.info_scale_array(op, info_scale, h, kd, cd),
    state0=_initial_state(op, diag, initial_state, b, h, kd, vd, cd),
    scale=kd**-0.5 if scale is None else scale,
  )


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


def _sequence_op(op, diag, doc):
  """The public sequence op `op` (diag: per-channel gain, else per-head), its signature spelled
  out once for both gains."""

  def kdn_op(
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
    arrays = (q, k, v, log_alpha, omega, r)
    choose = lambda kd, vd, tokens: resolve(op, impl, kd, vd, chunk_size, tokens)
    p = prepare(
      op, diag, arrays, info_scale, scale, initial_state, segment_ids, choose, output_states_at
    )
    if checked:
      _check_kdn_values(op, *p.inputs(), p.mu, p.state0, initial_state is not None)
    positions = p.positions

    def body(inputs, extra):
      q, k, v, log_alpha, omega, r = (inputs[n] for n in ("q", "k", "v", "log_alpha", "omega", "r"))
      state0, mu, segment_ids = extra["state0"], extra["mu"], extra["segment_ids"]
      scale = extra.get("scale", p.scale)
      if p.impl != "pallas":
        # (The Pallas kernels read each input in its own dtype and compute in fp32 inside: fp32
        # copies of 16-bit [B, T, H, K] inputs would be whole extra passes over HBM, three
        # converts of 50 us each in an H200 profile of the T=4096 forward, docs/decisions.md.)
        q, k, v, log_alpha, omega, r = (x.astype(p.cd) for x in (q, k, v, log_alpha, omega, r))
      at = ()
      if p.impl == "reference":
        starts = None if segment_ids is None else variance.segment_starts(segment_ids)
        o, (memory, var), *every = _kdn_reference(
          diag,
          q * scale,
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
          p.impl,
          k,
          log_alpha,
          omega,
          r,
          mu,
          state0.variance,
          segment_ids,
          p.input_dtype,
          positions,
          kernel_config,
        )
        o, memory, *mem_at = run_memory(
          op,
          p.impl,
          q,
          k,
          v,
          log_alpha,
          write,
          state0.memory,
          segment_ids,
          p.chunk_size,
          p.input_dtype,
          scale,
          positions,
          kernel_config,
        )
        if positions is not None:
          at = (KDNState(mem_at[0], var_at[0]),)
      return o.astype(p.out_dtype), memory, var, at

    extra = dict(state0=p.state0, mu=p.mu, segment_ids=segment_ids)
    if isinstance(p.scale, jax.Array):
      extra["scale"] = p.scale  # (traced: differentiable, so an argument of the guard's VJP)
    o, memory, var, at = nonfinite.guarded(
      body,
      p.impl,
      p.q,
      dict(k=p.k, v=p.v, log_alpha=p.log_alpha, omega=p.omega, r=p.r),
      extra,
      p.cd,
      variance=("k", "log_alpha", "omega", "r"),
      r_names=("r",),
    )
    final = KDNState(memory, var) if output_final_state else None
    return (o, final) + at

  return named(kdn_op, op, doc)


def named(fn, name, doc):
  """fn as the public function `name` documented by doc (ops made by a factory)."""
  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = doc
  return fn


diag_kdn = _sequence_op(
  "diag_kdn",
  True,
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
""",
)

iso_kdn = _sequence_op(
  "iso_kdn",
  False,
  """Isotropic Kalman Delta Network: like `diag_kdn` with omega [B, T, H]
and a per-head scalar variance (KDNState.variance [B, H]).""",
)


def _step_op(op, diag, doc):
  """The public decode step `op`, its signature spelled out once for both gains."""

  def kdn_step(
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
    if not isinstance(state, KDNState):
      raise TypeError(f"{op}: state must be a KDNState, got {type(state).__name__}")
    # The sequence op's prelude with T = 1.
    arrays = tuple(jnp.expand_dims(x, 1) for x in (q, k, v, log_alpha, omega, r))
    choose = lambda kd, vd, _: (dispatch.resolve_step_impl(op, impl, kd, vd), None)
    p = prepare(op, diag, arrays, info_scale, scale, state, None, choose)
    q, k, v, log_alpha, omega, r = (x[:, 0] for x in p.inputs())
    if checked:
      _check_kdn_values(op, q, k, v, log_alpha, omega, r, p.mu, p.state0, True)
    if p.impl == "pallas":
      # (the fused step reads each input in its own dtype and computes in fp32)
      o, memory, var = dispatch.pallas_module().decode.kdn_step(
        q,
        k,
        v,
        log_alpha,
        omega,
        r,
        p.mu,
        p.state0.memory,
        p.state0.variance,
        p.scale,
        diag=diag,
        config=dispatch.family_config(kernel_config, "decode"),
      )
      return o, KDNState(memory.astype(p.cd), var.astype(p.cd))
    q, k, v, log_alpha, omega, r = (x.astype(p.cd) for x in (q, k, v, log_alpha, omega, r))
    write, var = _gain_step(diag, p.mu)(p.state0.variance, k, log_alpha, omega, r)
    o, memory = delta_step(p.state0.memory, q * p.scale, k, v, log_alpha, write)
    return o.astype(p.out_dtype), KDNState(memory, var)

  return named(kdn_step, op, doc)


diag_kdn_step = _step_op(
  "diag_kdn_step",
  True,
  """One decode token of diag_kdn.

q, k: [B, H_k, K]; log_alpha, omega: [B, H, K]; v: [B, H, V]; r: [B, H];
state: KDNState (grouped value heads as in `diag_kdn`).
impl: 'pallas' runs the fused decode step (pallas_kernels.decode: gain,
decay, erase / write and read in one pass over the state, forward only);
'reference' (or 'chunked') the XLA step; 'auto': see
dispatch.resolve_step_impl.
Returns (o_t [B, H, V], new KDNState).
""",
)

iso_kdn_step = _step_op(
  "iso_kdn_step",
  False,
  """One decode token of iso_kdn (omega, r: [B, H]; variance [B, H]).""",
)
