"""The general delta rule and the named members of its family.

S_t = (I - w_t k_t^T) D_t S_{t-1} + w_t v_t^T,   o_t = scale * S_t^T q_t.
Wrappers keep flash-linear-attention's argument meaning.
"""

import jax
import jax.numpy as jnp

from kdn_jax.ops import dispatch, heads, nonfinite, states_at, widths
from kdn_jax.ops import validation as val
from kdn_jax.ops.delta_chunked import delta_rule_chunked
from kdn_jax.ops.delta_reference import delta_rule_reference, delta_step, scalar_write
from kdn_jax.ops.variance import segment_starts

DEFAULT_CHUNK = None  # per platform: see default_chunk_size


def default_chunk_size(impl):
  """Chunk length when the caller passes None.

  64 on GPU/TPU (and for Pallas) keeps the matrix units busy; on CPU the XLA
  chunked form is fastest with short chunks (measured: C=16 is 1.5-2.5x
  faster than C=64 forward+backward at T=4096, B=1, H=4, K=V=64).
  """
  if impl == "chunked" and jax.default_backend() == "cpu":
    return 16
  return dispatch.PALLAS_DEFAULT_CHUNK


def resolve(op, impl, kd, vd, chunk_size, tokens=None):
  """(impl, chunk_size) that run: chunk_size checked, then impl resolved for
  these widths and ``tokens`` = B*T*H (dispatch.resolve_impl), then the chunk
  default filled in."""
  if chunk_size is not None:
    val.check_chunk_size(op, chunk_size)
  state_bytes = None if tokens is None else 4 * tokens * kd * vd
  impl = dispatch.resolve_impl(op, impl, kd, vd, chunk_size, state_bytes)
  return impl, default_chunk_size(impl) if chunk_size is None else chunk_size


def check_args(op, q, k, v, log_alpha, write, initial_state, segment_ids):
  """delta_rule's argument checks -> ((B, T, H, K, V), compute dtype, the
  initial memory in it: zeros when initial_state is None)."""
  b, t, h, kd, vd = val.check_qkv(op, q, k, v)
  val.check_decay(op, "log_alpha", log_alpha, b, t, h, kd)
  val.check_float(op, "write", write)
  if write.shape not in ((b, t, h, kd), (b, t, h)):
    raise ValueError(
      f"{op}: write must have shape [B, T, H, K] = {(b, t, h, kd)} (a "
      f"direction) or [B, T, H] = {(b, t, h)} (a scalar beta: write = beta k), "
      f"got {tuple(write.shape)}"
    )
  val.check_segment_ids(op, segment_ids, b, t)
  if initial_state is not None:
    val.check_float(op, "initial_state", initial_state)
    val.check_shape(op, "initial_state", initial_state, (b, h, kd, vd), "[B, H, K, V]")
  cd = val.compute_dtype(q, k, v, log_alpha, write, initial_state)
  memory0 = jnp.zeros((b, h, kd, vd), cd) if initial_state is None else initial_state.astype(cd)
  return (b, t, h, kd, vd), cd, memory0


def run_memory(
  op,
  impl,
  q,
  k,
  v,
  log_alpha,
  write,
  memory0,
  segment_ids,
  chunk_size,
  input_dtype,
  scale,
  positions=None,
  kernel_config=None,
):
  """Runs the memory recurrence with impl; q, k, v already in compute dtype (the
  Pallas path takes log_alpha and write in their own dtypes), q not yet
  multiplied by `scale`.

  input_dtype (the caller's q/k/v dtype) sets the Pallas dot precision: 'fast'
  (bf16 operands, fp32 accumulation) for bf16/fp16 data, fp32-accurate for
  fp32/fp64 data. write: [B, T, H, K], or [B, T, H]: beta with write = beta k
  (the Pallas kernels form it themselves). positions: None, or checked
  output_states_at (states_at.check_positions): then also returns the memory
  after each position [B, P, H, K, V]. kernel_config: the Pallas kernels' configs
  (pallas_kernels.KernelConfigs) or None (the tuned ones).
  """
  if impl == "pallas":
    # resolve_impl has checked that the kernels import and take these widths
    # and this chunk size: an explicit 'pallas' never falls back silently.
    kernels = dispatch.pallas_module()
    # q, k, v were all 16-bit when their result type is: casting back is exact,
    # and the kernels read half the bytes (they compute in fp32 inside).
    narrow = jnp.dtype(input_dtype).itemsize == 2
    kq, kk, kv = ((x.astype(input_dtype) if narrow else x) for x in (q, k, v))
    if positions is None:
      # (widths the kernels do not take are padded and tiled onto theirs: widths.py)
      return widths.delta_rule(
        kernels,
        kq,
        kk,
        kv,
        log_alpha,
        write,
        scale,
        memory0,
        segment_ids,
        chunk_size=chunk_size,
        precision=kernels.precision_for(input_dtype),
        config=dispatch.family_config(kernel_config, "delta_rule"),
      )
    chunk_widths = kernels.common.CHUNK_WIDTHS
    if not (k.shape[-1] in chunk_widths and v.shape[-1] in chunk_widths):
      raise ValueError(
        f"{op}: output_states_at with impl='pallas' needs K and V among the "
        f"kernels' widths {chunk_widths}, got K={k.shape[-1]}, "
        f"V={v.shape[-1]}; use impl='chunked'"
      )
    out = kernels.delta_rule(
      kq,
      kk,
      kv,
      log_alpha,
      write,
      scale,
      memory0,
      segment_ids,
      chunk_size=chunk_size,
      precision=kernels.precision_for(input_dtype),
      output_chunk_states=True,
      config=dispatch.family_config(kernel_config, "delta_rule"),
    )
    o, memory, chunk_states, chunk = out
    return (
      o,
      memory,
      states_at.memory_at(
        positions,
        chunk,
        chunk_states,
        memory.astype(memory0.dtype),
        k,
        v,
        log_alpha,
        write,
        memory0,
        segment_ids,
      ),
    )
  q = q * scale
  if write.ndim == 3:
    write = scalar_write(write, k)
  if impl == "chunked":
    out = delta_rule_chunked(
      q,
      k,
      v,
      log_alpha,
      write,
      memory0,
      segment_ids,
      chunk_size=chunk_size,
      output_chunk_states=positions is not None,
    )
    if positions is None:
      return out
    o, memory, chunk_states = out
    return (
      o,
      memory,
      states_at.memory_at(
        positions, chunk_size, chunk_states, memory, k, v, log_alpha, write, memory0, segment_ids
      ),
    )
  starts = None if segment_ids is None else segment_starts(segment_ids)
  if positions is None:
    return delta_rule_reference(q, k, v, log_alpha, write, memory0, starts)
  o, memory, every = delta_rule_reference(
    q, k, v, log_alpha, write, memory0, starts, keep_states=True
  )
  return o, memory, states_at.gather_tokens(every, positions)


def delta_rule(
  q,
  k,
  v,
  log_alpha,
  write,
  *,
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
  """General delta rule with write direction `write` and erase direction `k`.

  Args:
    q, k: [B, T, H_k, K]; v: [B, T, H, V], H a multiple of H_k (grouped value
      heads: value head j reads q/k head j // (H / H_k); heads.py). Everything
      else, the output and the state have the H value heads.
    write: [B, T, H, K], or [B, T, H]: a per-token scalar beta, write = beta * k
      (the Pallas GPU kernels then form beta * k themselves: no [B, T, H, K]
      write array in memory; the other impls and TPU form it in XLA).
    log_alpha: [B, T, H, K] per-channel or [B, T, H] scalar log decay (<= 0).
    scale: query scale, default K ** -0.5.
    initial_state: memory [B, H, K, V] or None (zeros).
    output_final_state: also return the final memory.
    segment_ids: [B, T] ints for packed sequences, or None.
    impl: 'auto', 'reference', 'chunked' or 'pallas'.
    chunk_size: chunk length of the chunked/pallas paths (None: per platform).
    checked: check log_alpha <= 0 (-inf, a full forget, allowed) and that
      q, k, v, write and initial_state are finite, and raise
      `ops.InvalidValueError` naming the argument; under jit wrap the caller
      in `ops.checked`.
    output_states_at: None, or positions [P] (ints known when tracing, sorted,
      in [1, T]): also return the memory after each position p (the final
      state of the op on the first p tokens), from the chunk states the
      state pass holds (kdn_jax.ops.states_at); differentiable.
    kernel_config: the Pallas kernels' configs (a pallas_kernels.KernelConfigs: frozen, hashable,
      part of jit's cache key when passed as a static argument), or None: the tuned ones for
      the device (pallas_kernels/tuned.py). Only impl='pallas' reads it.

  Returns:
    (o [B, T, H, V] in q's dtype, final memory [B, H, K, V] or None), and with
    output_states_at a third entry: the memory after each position
    [B, P, H, K, V].
  """
  op = "delta_rule"
  q, k = heads.to_value_heads(op, q, k, v)
  (b, t, h, kd, vd), cd, memory0 = check_args(
    op, q, k, v, log_alpha, write, initial_state, segment_ids
  )
  positions = states_at.check_positions(op, output_states_at, t)
  if checked:
    val.check_values(
      op,
      (("log_alpha", log_alpha, "<= 0"),)
      + _finite(q=q, k=k, v=v, write=write, initial_state=initial_state),
    )
  impl, chunk_size = resolve(op, impl, kd, vd, chunk_size, b * t * h)
  scale = kd**-0.5 if scale is None else scale
  input_dtype = jnp.result_type(q, k, v)
  out_dtype = q.dtype

  def body(inputs, extra):
    q, k, v, log_alpha, write = (inputs[n] for n in ("q", "k", "v", "log_alpha", "write"))
    if impl != "pallas":
      # (the Pallas kernels read log_alpha and write in their own dtypes, fp32 inside: a cast
      # here would be a pass over memory, e.g. of a bf16 kappa, pallas_kernels.write_dtype)
      log_alpha, write = log_alpha.astype(cd), write.astype(cd)
    o, memory, *at = run_memory(
      op,
      impl,
      q.astype(cd),
      k.astype(cd),
      v.astype(cd),
      log_alpha,
      write,
      extra["memory0"],
      extra["segment_ids"],
      chunk_size,
      input_dtype,
      extra.get("scale", scale),
      positions,
      kernel_config,
    )
    return o.astype(out_dtype), memory, None, tuple(at)

  extra = dict(memory0=memory0, segment_ids=segment_ids)
  if isinstance(scale, jax.Array):
    extra["scale"] = scale  # (traced: differentiable, so an argument of the guard's VJP)
  o, memory, _, at = nonfinite.guarded(
    body, impl, q, dict(k=k, v=v, log_alpha=log_alpha, write=write), extra, cd
  )
  return (o, (memory if output_final_state else None)) + tuple(at)


def delta_rule_step(
  q, k, v, log_alpha, write, memory, *, scale=None, checked=False, impl="auto", kernel_config=None
):
  """One decode step. q, k [B, H_k, K]; write [B, H, K], or [B, H] (beta:
  write = beta k); v [B, H, V]; log_alpha [B, H, K] or [B, H]; memory
  [B, H, K, V]; H a multiple of H_k (grouped value heads, as in `delta_rule`).
  impl: 'pallas' runs the fused decode step (pallas_kernels.decode, forward
  only), 'reference' (or 'chunked') the XLA step; 'auto': see
  dispatch.resolve_step_impl. kernel_config: as in `delta_rule` (its decode member). Returns
  (o_t [B, H, V], new memory)."""
  op = "delta_rule_step"
  q, k = heads.to_value_heads(op, q, k, v, axis=1)
  for name, x in (
    ("q", q),
    ("k", k),
    ("v", v),
    ("log_alpha", log_alpha),
    ("write", write),
    ("memory", memory),
  ):
    val.check_float(op, name, x)
  b, h, kd = q.shape
  vd = v.shape[-1]
  val.check_shape(op, "k", k, (b, h, kd), "[B, H, K]")
  if write.shape not in ((b, h, kd), (b, h)):
    raise ValueError(
      f"{op}: write must have shape [B, H, K] = {(b, h, kd)} (a direction) or "
      f"[B, H] = {(b, h)} (a scalar beta: write = beta k), got {tuple(write.shape)}"
    )
  val.check_shape(op, "v", v, (b, h, vd), "[B, H, V]")
  val.check_shape(op, "memory", memory, (b, h, kd, vd), "[B, H, K, V]")
  if log_alpha.shape not in ((b, h, kd), (b, h)):
    raise ValueError(
      f"{op}: log_alpha must have shape [B, H, K] or [B, H], got {tuple(log_alpha.shape)}"
    )
  if checked:
    val.check_values(
      op, (("log_alpha", log_alpha, "<= 0"),) + _finite(q=q, k=k, v=v, write=write, memory=memory)
    )
  cd = val.compute_dtype(q, k, v, log_alpha, write, memory)
  scale = kd**-0.5 if scale is None else scale
  if dispatch.resolve_step_impl(op, impl, kd, vd) == "pallas":
    o, memory = dispatch.pallas_module().decode.delta_rule_step(
      q,
      k,
      v,
      log_alpha,
      write,
      memory,
      scale,
      config=dispatch.family_config(kernel_config, "decode"),
    )
    return o, memory.astype(cd)
  if write.ndim == 2:
    write = scalar_write(write, k)
  o, memory = delta_step(
    memory.astype(cd),
    q.astype(cd) * scale,
    k.astype(cd),
    v.astype(cd),
    log_alpha.astype(cd),
    write.astype(cd),
  )
  return o.astype(q.dtype), memory


def beta_times(beta, x):
  return beta[..., None] * x if beta.ndim == x.ndim - 1 else beta * x


def beta_write(beta, k):
  """delta_rule's write for write = beta * k: beta itself when it is one scalar per token
  ([B, T, H]), else the product."""
  return beta if beta.ndim == k.ndim - 1 else beta_times(beta, k)


def _finite(**arrays):
  """Checked-mode rules: each of these inputs finite (None: not given)."""
  return tuple((name, x, "finite") for name, x in arrays.items())


def _check_gate(op, g, kwargs, **inputs):
  """Checked mode of a wrapper, with its own argument names (delta_rule's would
  name the wrong ones): the decay g <= 0 (-inf allowed), the inputs finite."""
  if kwargs.pop("checked", False):
    gate = () if g is None else (("g (log decay)", g, "<= 0"),)
    if "memory" not in inputs:  # (a sequence op: its initial state)
      inputs["initial_state"] = kwargs.get("initial_state")
    val.check_values(op, gate + _finite(**inputs))
  return kwargs


def kda(q, k, v, g, beta, **kwargs):
  """Kimi Delta Attention: per-channel decay g [B,T,H,K], write beta * k."""
  q, k = heads.to_value_heads("kda", q, k, v)
  kwargs = _check_gate("kda", g, kwargs, q=q, k=k, v=v, beta=beta)
  return delta_rule(q, k, v, g, beta_write(beta, k), **kwargs)


def gated_delta_rule(q, k, v, g, beta, **kwargs):
  """Gated DeltaNet: scalar decay g [B,T,H], write beta * k."""
  q, k = heads.to_value_heads("gated_delta_rule", q, k, v)
  kwargs = _check_gate("gated_delta_rule", g, kwargs, q=q, k=k, v=v, beta=beta)
  return delta_rule(q, k, v, g, beta_write(beta, k), **kwargs)


def delta_net(q, k, v, beta, **kwargs):
  """DeltaNet: no decay, write beta * k."""
  q, k = heads.to_value_heads("delta_net", q, k, v)
  kwargs = _check_gate("delta_net", None, kwargs, q=q, k=k, v=v, beta=beta)
  return delta_rule(q, k, v, jnp.zeros(q.shape[:3], q.dtype), beta_write(beta, k), **kwargs)


def gdn2(q, k, v, g, b, w, **kwargs):
  """GDN-2: S_t = (I - k_t (b_t*k_t)^T) D_t S + k_t (w_t*v_t)^T.

  The read/erase key is b * k, the write direction k, the value w * v;
  b is [B,T,H,K] or [B,T,H], w is [B,T,H,V] or [B,T,H].
  """
  q, k = heads.to_value_heads("gdn2", q, k, v)
  kwargs = _check_gate("gdn2", g, kwargs, q=q, k=k, v=v, b=b, w=w)
  return delta_rule(q, beta_times(b, k), beta_times(w, v), g, k, **kwargs)


def gla(q, k, v, g, **kwargs):
  """Gated linear attention (Mamba-2/GLA style): S_t = D_t S + k_t v_t^T.

  g: [B,T,H,K] or [B,T,H]. No erase: the erase key is zero.
  """
  q, k = heads.to_value_heads("gla", q, k, v)
  kwargs = _check_gate("gla", g, kwargs, q=q, k=k, v=v)
  return delta_rule(q, jnp.zeros_like(k), v, g, k, **kwargs)


# Decode steps of the named members: one token, the same arguments as the
# parallel op without T, and the memory [B, H, K, V] the parallel op returns as
# its final state (so a prefill's final state continues token by token).
# Every member takes grouped value heads like `delta_rule`: q, k with H_k heads,
# the rest with H, a multiple of H_k.


def kda_step(
  q, k, v, g, beta, memory, *, scale=None, checked=False, impl="auto", kernel_config=None
):
  """One token of `kda`: q, k, g [B,H,K]; v [B,H,V]; beta [B,H]."""
  q, k = heads.to_value_heads("kda_step", q, k, v, axis=1)
  _check_gate("kda_step", g, dict(checked=checked), q=q, k=k, v=v, beta=beta, memory=memory)
  return delta_rule_step(
    q, k, v, g, beta_write(beta, k), memory, scale=scale, impl=impl, kernel_config=kernel_config
  )


def gated_delta_rule_step(
  q, k, v, g, beta, memory, *, scale=None, checked=False, impl="auto", kernel_config=None
):
  """One token of `gated_delta_rule`: g, beta [B,H]."""
  q, k = heads.to_value_heads("gated_delta_rule_step", q, k, v, axis=1)
  _check_gate(
    "gated_delta_rule_step", g, dict(checked=checked), q=q, k=k, v=v, beta=beta, memory=memory
  )
  return delta_rule_step(
    q, k, v, g, beta_write(beta, k), memory, scale=scale, impl=impl, kernel_config=kernel_config
  )


def delta_net_step(q, k, v, beta, memory, *, scale=None, impl="auto", kernel_config=None):
  """One token of `delta_net` (no decay): beta [B,H]."""
  q, k = heads.to_value_heads("delta_net_step", q, k, v, axis=1)
  return delta_rule_step(
    q,
    k,
    v,
    jnp.zeros(q.shape[:2], q.dtype),
    beta_write(beta, k),
    memory,
    scale=scale,
    impl=impl,
    kernel_config=kernel_config,
  )


def gdn2_step(
  q, k, v, g, b, w, memory, *, scale=None, checked=False, impl="auto", kernel_config=None
):
  """One token of `gdn2`: b [B,H,K] or [B,H]; w [B,H,V] or [B,H]."""
  q, k = heads.to_value_heads("gdn2_step", q, k, v, axis=1)
  _check_gate("gdn2_step", g, dict(checked=checked), q=q, k=k, v=v, b=b, w=w, memory=memory)
  return delta_rule_step(
    q,
    beta_times(b, k),
    beta_times(w, v),
    g,
    k,
    memory,
    scale=scale,
    impl=impl,
    kernel_config=kernel_config,
  )


def gla_step(q, k, v, g, memory, *, scale=None, checked=False, impl="auto", kernel_config=None):
  """One token of `gla` (no erase): g [B,H,K] or [B,H]."""
  q, k = heads.to_value_heads("gla_step", q, k, v, axis=1)
  _check_gate("gla_step", g, dict(checked=checked), q=q, k=k, v=v, memory=memory)
  return delta_rule_step(
    q, jnp.zeros_like(k), v, g, k, memory, scale=scale, impl=impl, kernel_config=kernel_config
  )
