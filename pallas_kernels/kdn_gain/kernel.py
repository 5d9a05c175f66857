"""Pallas kernels for the Kalman gain recurrence, written over generic "lanes".

Per (batch, head) there are L lanes (L = K channels for the diagonal gain, L = 1 for the isotropic
one). Per token t and lane i the inputs are
    a   decay multiplier (alpha^2, or mean alpha^2),  om  process noise,  u  information gain,
    kx  numerator factor,  kk  quadratic weight,      r   observation noise (per token, shared by lanes)
and the recurrence is
    p_hat = a p + om;  den = r + sum_i p_hat_i kk_i;  gain = p_hat kx / den;  p = p_hat / (1 + u p_hat)
with p reset to p0 before every token whose reset flag is set (token 0 always resets). The lanes
are formed inside the kernels from the raw inputs (k, log_alpha, omega, r, mu: `_lanes`), and the
backward emits the raw inputs' gradients (`_raw_grads`): no fp32 lane arrays go through memory.

With a `front` (the gate front-end: r_min, a Python float), the raw inputs are the layer's gate
projections before their activations (k, f, dt_bias, A_log, omega_raw, r_raw, mu) and the
kernels apply them:
    log_alpha = -exp(A_log) softplus(f + dt_bias),  omega = softplus(omega_raw),
    r = r_min + softplus(r_raw)
so the fp32 log_alpha and omega arrays are never formed in XLA. The forward still writes log_alpha
(the delta-rule kernels need it); the backward takes that output's cotangent, adds it to the
gain's own log_alpha gradient and emits the projections' gradients (in their dtype) plus
per-chunk partial sums for dt_bias and A_log (summed outside, like dp0).

The variance update is the Moebius map M_t = [[a, om], [u a, 1 + u om]] (a reset token uses M_t R, R
the constant map to p0). Forward = two kernels (the isotropic gain's replay runs over per-token scalars the reduce
writes instead: iso_replay.py):
  1. `_reduce_kernel`: per chunk (grid (B, H, NC)), the renormalised product of the chunk's M_t.
  2. `_replay_kernel`: per chunk, the exclusive carry (the products of all earlier chunks applied to
     p0, serial over chunks but only a 2x2 map per step), then a token replay emitting the gain, the
     final variance and, when differentiated (`save_pprev`), the variance p_{t-1} each token
     started from (the backward's residual).
Backward = two kernels over the linear adjoint recurrence dp_{t-1} = m_t dp_t + c_t:
  3. `_bwd_reduce_kernel`: per chunk, the composed affine map (m, c) from chunk-end to chunk-start.
  4. `_bwd_replay_kernel`: per chunk, the carry from later chunks, then a reverse token replay that
     emits every raw input's gradient, plus each chunk's dp0 contribution (from its resets).

UNSEGMENTED (`segmented=False`, a call without segment_ids): only token 0 resets, to p0, where
chunk 0's replay starts anyway (its carry-in is p0), so the kernels read no reset flags and
select nothing per token. Chunk 0's product then leaves R out, which the carry-in, applying it
to p0, does not see; the backward's dp0 is chunk 0's final adjoint (token 0's dp_{t-1}).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common, kernel_math
from pallas_kernels.kdn_gain import iso_replay, moebius


def _row(ref, b, t, h):
  """Loads lane row [1, L] (4-D ref) or scalar row [1] (3-D ref) at (b, t, h)."""
  if len(ref.shape) == 4:
    return ref[b, pl.ds(t, 1), h, :].astype(jnp.float32)
  return ref[b, pl.ds(t, 1), h].astype(jnp.float32)


RAW = ("k", "la", "om", "r", "mu")  # the kernels' raw inputs, in this order
# ... with the gate front-end: the pre-activation projections and the front-end parameters
RAW_FRONT = ("k", "f", "dt_bias", "a_log", "om", "r", "mu")
# gradients the backward writes per token (front: f in place of la; dt_bias / A_log as partials)
GRADS = ("k", "la", "om", "r", "mu")
GRADS_FRONT = ("k", "f", "om", "r", "mu")


def raw_names(front):
  return RAW if front is None else RAW_FRONT


def _front(raw, b, t, h, front):
  """The gate front-end at token t: (log_alpha [1, K], omega row, r row, what its chain rule
  needs). `front` is r_min (r's floor)."""
  exp = kernel_math.exp_for(raw["k"].dtype)
  softplus = kernel_math.softplus_for(raw["k"].dtype)
  sigmoid = lambda x: kernel_math.sigmoid(x, exp)
  z = _row(raw["f"], b, t, h) + raw["dt_bias"][pl.ds(h, 1), :].astype(jnp.float32)
  a_scale = exp(raw["a_log"][pl.ds(h, 1)].astype(jnp.float32))[:, None]  # [1, 1]
  la = -a_scale * softplus(z)
  om_raw = _row(raw["om"], b, t, h)
  r_raw = _row(raw["r"], b, t, h)
  chain = dict(
    la=la, a_scale=a_scale, sig_z=sigmoid(z), sig_om=sigmoid(om_raw), sig_r=sigmoid(r_raw)
  )
  return la, softplus(om_raw), front + softplus(r_raw), chain


def _lanes(raw, b, t, h, diag, front=None):
  """Token t's lane inputs, formed in the kernel from the raw rows (the raw inputs are read once,
  in their own dtype, instead of five fp32 lane arrays made in XLA):
    diag: kx = k, kk = k^2, a = exp(2 la), om, u = mu k^2 / r            (lanes: K channels)
    iso:  kx = 1, kk = |k|^2, a = mean exp(2 la), om, u = mu |k|^2 / (K r)  (one lane)
  r is a [1, 1] column; `k` and `e2` = exp(2 la) are kept for the raw gradients (with a front,
  also log_alpha itself and the front-end's derivatives, under "front")."""
  k = _row(raw["k"], b, t, h)
  if front is None:
    la, om, r = _row(raw["la"], b, t, h), _row(raw["om"], b, t, h), _row(raw["r"], b, t, h)
    chain = None
  else:
    la, om, r, chain = _front(raw, b, t, h, front)
  e2 = kernel_math.exp_for(raw["k"].dtype)(2.0 * la)
  r = r[:, None]
  mu = raw["mu"][pl.ds(h, 1)].astype(jnp.float32)[:, None]
  if diag:
    kk = k * k
    # (one division per token, not one per lane: mu / r is shared by the lanes)
    return dict(a=e2, om=om, u=kk * (mu / r), kx=k, kk=kk, r=r, k=k, e2=e2, mu=mu, front=chain)
  kk = jnp.sum(k * k, axis=1, keepdims=True)
  return dict(
    a=jnp.mean(e2, axis=1, keepdims=True),
    om=om[:, None],
    u=mu * kk / (k.shape[1] * r),
    kx=jnp.ones_like(kk),
    kk=kk,
    r=r,
    k=k,
    e2=e2,
    mu=mu,
    front=chain,
  )


def _raw_grads(x, g, diag):
  """Chain rule from the lane gradients g (see _bwd_token) through _lanes to the raw inputs;
  mu's is per token (summed over (batch, time) outside)."""
  k, r, mu = x["k"], x["r"], x["mu"]
  gu_r = g["u"] / r
  if diag:
    return dict(
      k=g["kx"] + 2.0 * k * (g["kk"] + mu * gu_r),
      la=2.0 * x["e2"] * g["a"],
      om=g["om"],
      r=g["r"] - jnp.sum(gu_r * x["u"], axis=1),
      mu=jnp.sum(gu_r * x["kk"], axis=1),
    )
  kd = k.shape[1]
  return dict(
    k=2.0 * k * (g["kk"] + mu * gu_r / kd),
    la=(2.0 / kd) * x["e2"] * g["a"],
    om=g["om"].reshape(-1),
    r=g["r"] - (gu_r * x["u"]).reshape(-1),
    mu=(gu_r * x["kk"]).reshape(-1) / kd,
  )


def _front_grads(x, d, dla_out):
  """Continues _raw_grads through the gate front-end: `dla_out` is the cotangent of the
  log_alpha the forward emitted (from the delta rule), added to the gain's own. Returns the
  per-token gradients (f in place of la) and this token's dt_bias and A_log shares ([1, K]
  rows: d/d dt_bias = d/d f; d la / d A_log = la)."""
  c = x["front"]
  dla = d["la"] + dla_out
  df = dla * (-c["a_scale"]) * c["sig_z"]
  grads = dict(k=d["k"], f=df, om=d["om"] * c["sig_om"], r=d["r"] * c["sig_r"], mu=d["mu"])
  return grads, df, dla * c["la"]


def _token_matrix(a, om, u, reset, p0):
  """M_t, or M_t R where `reset` is set (None: no resets, UNSEGMENTED above)."""
  m11, m12 = a, om
  m21, m22 = u * a, 1.0 + u * om
  if reset is None:
    return m11, m12, m21, m22
  # Reset: M R with R = [[0, p0], [0, 1]].
  r12 = m11 * p0 + m12
  r22 = m21 * p0 + m22
  zero = jnp.zeros_like(a)
  return (
    jnp.where(reset, zero, m11),
    jnp.where(reset, r12, m12),
    jnp.where(reset, zero, m21),
    jnp.where(reset, r22, m22),
  )


def _pow2_inverse(s):
  """2^-e for s = m 2^e > 0 (1 <= m < 2): the exponent field negated by integer ops, no
  division. Scaling by it is exact and puts s in [1, 2) for normal s below 2^126; larger s
  (and inf, NaN) get 2^-126 (s in [1, 4) or left non-finite, never 0), a subnormal s 2^127."""
  bits = jnp.minimum(lax.bitcast_convert_type(s, jnp.int32) & 0x7F800000, 0x7E800000)
  return lax.bitcast_convert_type(0x7F000000 - bits, jnp.float32)


def _product2(x, y):
  """x @ y for 2x2 matrices stored as 4-tuples of lane vectors."""
  x11, x12, x21, x22 = x
  y11, y12, y21, y22 = y
  return (
    x11 * y11 + x12 * y21,
    x11 * y12 + x12 * y22,
    x21 * y11 + x22 * y21,
    x21 * y12 + x22 * y22,
  )


def _matmul2(x, y):
  """x @ y for 2x2 matrices stored as 4-tuples of lane vectors, renormalised so that the largest
  |entry| is in [1, 2). A Moebius map is the same map at any scale of its matrix, so any
  positive factor would do: a power of two (_pow2_inverse) is exact and needs no division."""
  n11, n12, n21, n22 = _product2(x, y)
  s = jnp.maximum(jnp.maximum(jnp.abs(n11), jnp.abs(n12)), jnp.maximum(jnp.abs(n21), jnp.abs(n22)))
  inv = _pow2_inverse(jnp.where(s > 0, s, 1.0))
  return n11 * inv, n12 * inv, n21 * inv, n22 * inv


def _raw_refs(refs, front):
  names = raw_names(front)
  return dict(zip(names, refs[: len(names)])), refs[len(names) :]


def _reduce_kernel(*refs, chunk, diag, front, segmented, scalars):
  """Chunk c's renormalised map product. With `scalars` (iso_replay.py) it also writes each
  token's a and kk ([B, T, H] fp32) and, with a front, log_alpha: what the scalar replay would
  otherwise re-read the K-wide rows for."""
  raw, (reset_ref, p0_ref, prod_ref, *scalar_refs) = _raw_refs(refs, front)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  p0 = p0_ref[b, h, :].astype(jnp.float32)[None, :]
  t0 = c * chunk

  def token(t, m):
    x = _lanes(raw, b, t, h, diag, front)
    if scalars:
      scalar_refs[0][b, pl.ds(t, 1), h] = x["a"].reshape(1)
      scalar_refs[1][b, pl.ds(t, 1), h] = x["kk"].reshape(1)
      if front is not None:
        scalar_refs[2][b, pl.ds(t, 1), h, :] = x["front"]["la"].astype(scalar_refs[2].dtype)
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0 if segmented else None
    mt = _token_matrix(x["a"], x["om"], x["u"], reset, p0)
    return _matmul2(mt, m)  # renormalised every token (by a power of two: exact)

  def body(i, m):
    return token(t0 + i, m)

  one = jnp.ones_like(p0)
  zero = jnp.zeros_like(p0)
  m = lax.fori_loop(0, chunk, body, (one, zero, zero, one))
  for j in range(4):
    prod_ref[b, h, c, j, :] = m[j].reshape(-1)


def _carry_in(prod_ref, p0, b, h, c):
  """Variance at the start of chunk c: chunk maps 0..c-1 applied to p0."""
  return moebius.apply_maps(
    lambda j: tuple(prod_ref[b, h, j, i, :][None, :] for i in range(4)), p0, c
  )


def _replay_kernel(*refs, chunk, num_chunks, diag, save_pprev, front, segmented):
  raw, rest = _raw_refs(refs, front)
  reset_ref, p0_ref, prod_ref, gain_ref = rest[:4]
  rest = rest[4:]
  la_ref, rest = (None, rest) if front is None else (rest[0], rest[1:])
  pprev_ref, pfin_ref = rest if save_pprev else (None, rest[0])
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  p0 = p0_ref[b, h, :].astype(jnp.float32)[None, :]
  p = _carry_in(prod_ref, p0, b, h, c)
  t0 = c * chunk

  def body(i, p):
    t = t0 + i
    if segmented:
      p = jnp.where(reset_ref[b, pl.ds(t, 1)][:, None] > 0, p0, p)
    x = _lanes(raw, b, t, h, diag, front)
    if front is not None:  # the delta rule's decay, from the same front-end evaluation
      la_ref[b, pl.ds(t, 1), h, :] = x["front"]["la"].astype(la_ref.dtype)
    p_hat = x["a"] * p + x["om"]
    den = x["r"] + jnp.sum(p_hat * x["kk"], axis=1, keepdims=True)
    gain = p_hat * x["kx"] * (1.0 / den)  # (one division per token, not per lane)
    gain_ref[b, pl.ds(t, 1), h, :] = gain.astype(gain_ref.dtype)
    if save_pprev:
      pprev_ref[b, pl.ds(t, 1), h, :] = p
    return p_hat / (1.0 + x["u"] * p_hat)

  p = lax.fori_loop(0, chunk, body, p)

  @pl.when(c == num_chunks - 1)
  def _():
    pfin_ref[b, h, :] = p.reshape(-1)


def _bwd_token(t, b, h, raw, pprev_ref, dgain_ref, dp, diag, front):
  """One reverse step. Returns (lane gradients, lanes, dp_hat, m, c, a) where
  dp_prev = m * dp + c (before resets)."""
  x = _lanes(raw, b, t, h, diag, front)
  a, om, u, kx, kk, r = (x[n] for n in ("a", "om", "u", "kx", "kk", "r"))
  p_prev = _row(pprev_ref, b, t, h)
  dgain = _row(dgain_ref, b, t, h)
  p_hat = a * p_prev + om
  den = r + jnp.sum(p_hat * kk, axis=1, keepdims=True)
  inv_den = 1.0 / den
  gain = p_hat * kx * inv_den
  dden = -jnp.sum(dgain * gain, axis=1, keepdims=True) * inv_den
  q = dgain * kx * inv_den + dden * kk  # dp_hat from the gain (independent of dp)
  s = 1.0 / (1.0 + u * p_hat)
  p_new = p_hat * s
  m = s * s  # dp_hat / dp_new
  dp_hat = m * dp + q
  grads = dict(
    kx=dgain * p_hat * inv_den,
    kk=dden * p_hat,
    r=dden.reshape(-1),
    u=-dp * p_new * p_new,
    a=dp_hat * p_prev,
    om=dp_hat,
  )
  return grads, x, dp_hat, a * m, a * q, a


def _bwd_reduce_kernel(*refs, chunk, diag, front, segmented):
  raw, (pprev_ref, dgain_ref, reset_ref, map_ref) = _raw_refs(refs, front)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_last = c * chunk + chunk - 1

  def body(i, mc):
    mm, cc = mc
    t = t_last - i
    # dp_t = mm * dp_out + cc  ->  dp_{t-1} = m_t dp_t + c_t.
    _, _, _, m_t, c_t, _ = _bwd_token(
      t, b, h, raw, pprev_ref, dgain_ref, jnp.zeros_like(mm), diag, front
    )
    if segmented:
      reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
      m_t = jnp.where(reset, 0.0, m_t)
      c_t = jnp.where(reset, 0.0, c_t)
    return m_t * mm, m_t * cc + c_t

  one = jnp.ones((1, pprev_ref.shape[-1]), jnp.float32)
  mm, cc = lax.fori_loop(0, chunk, body, (one, jnp.zeros_like(one)))
  map_ref[b, h, c, 0, :] = mm.reshape(-1)
  map_ref[b, h, c, 1, :] = cc.reshape(-1)


def _bwd_replay_kernel(*refs, chunk, num_chunks, diag, front, segmented):
  raw, rest = _raw_refs(refs, front)
  pprev_ref, dgain_ref, reset_ref, map_ref, dpfin_ref = rest[:5]
  rest = rest[5:]
  dla_out_ref, rest = (None, rest) if front is None else (rest[0], rest[1:])
  d_refs = dict(zip(GRADS if front is None else GRADS_FRONT, rest[:5]))
  dp0_ref = rest[5]
  dparam_refs = rest[6:]  # front: per-chunk dt_bias and A_log partials [B, H, NC, K]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  dp_fin = dpfin_ref[b, h, :].astype(jnp.float32)[None, :]

  def carry_body(j, dp):
    jj = num_chunks - 1 - j
    return map_ref[b, h, jj, 0, :][None, :] * dp + map_ref[b, h, jj, 1, :][None, :]

  dp = lax.fori_loop(0, num_chunks - 1 - c, carry_body, dp_fin)
  t_last = c * chunk + chunk - 1

  def body(i, state):
    dp, dp0, dparams = state
    t = t_last - i
    g, x, dp_hat, _, _, a = _bwd_token(t, b, h, raw, pprev_ref, dgain_ref, dp, diag, front)
    grads = _raw_grads(x, g, diag)
    if front is not None:
      grads, d_dt, d_alog = _front_grads(x, grads, _row(dla_out_ref, b, t, h))
      dparams = (dparams[0] + d_dt, dparams[1] + d_alog)
    for name, val in grads.items():
      ref = d_refs[name]
      if len(ref.shape) == 4:
        ref[b, pl.ds(t, 1), h, :] = val.astype(ref.dtype)
      else:
        ref[b, pl.ds(t, 1), h] = val.astype(ref.dtype)
    dprev = a * dp_hat
    if not segmented:  # (token 0's reset: dp0 is chunk 0's final dp, below)
      return dprev, dp0, dparams
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
    dp0 = dp0 + jnp.where(reset, dprev, 0.0)
    dp = jnp.where(reset, 0.0, dprev)
    return dp, dp0, dparams

  kd = raw["k"].shape[-1]
  dparams = () if front is None else (jnp.zeros((1, kd), jnp.float32),) * 2
  dp, dp0, dparams = lax.fori_loop(0, chunk, body, (dp, jnp.zeros_like(dp), dparams))
  if not segmented:
    dp0 = jnp.where(c == 0, dp, 0.0)
  dp0_ref[b, h, c, :] = dp0.reshape(-1)
  for ref, val in zip(dparam_refs, dparams):
    ref[b, h, c, :] = val.reshape(-1)


# ----------------------------------------------------------------------------------------------
# Wrappers (all arrays already padded to a multiple of the chunk).


def _launch(r, chunk, interpret, cfg, backward):
  """Sizes, grid (batch, head, chunk) and pallas_call options of one gain pass."""
  bsz, t, nh = r.shape
  stages = cfg.num_stages_bwd if backward else cfg.num_stages_fwd
  params = dict(interpret=interpret, compiler_params=common.compiler_params(cfg.num_warps, stages))
  return bsz, t, nh, t // chunk, (bsz, nh, t // chunk), params


def _log_alpha_out(k, front):
  """The forward's log_alpha output (with a front only; written by the replay, or by the reduce
  for the scalar replay)."""
  return () if front is None else (jax.ShapeDtypeStruct(k.shape, jnp.float32),)


def reduce_maps(
  raw, reset, p0, *, diag, chunk, interpret, cfg, front=None, segmented=True, scalars=False
):
  """The forward reduce: (the chunk maps [B, H, NC, 4, L] fp32, renormalised every token, and
  with `scalars` (iso_replay.py) a, kk [B, T, Hp] fp32 and, with a front, log_alpha). reset:
  [B, T] int32."""
  r, k = raw[-2], raw[0]
  bsz, t, nh, nc, grid, params = _launch(r, chunk, interpret, cfg, backward=False)
  scalar_out = ()
  if scalars:  # a and kk, as wide as the scalar replay's head row
    per_token = jax.ShapeDtypeStruct((bsz, t, common.next_pow2(nh)), jnp.float32)
    scalar_out = (per_token, per_token) + _log_alpha_out(k, front)
  return pl.pallas_call(
    functools.partial(
      _reduce_kernel,
      chunk=chunk,
      diag=diag,
      front=front,
      segmented=segmented,
      scalars=scalars,
    ),
    out_shape=(jax.ShapeDtypeStruct((bsz, nh, nc, 4, p0.shape[-1]), jnp.float32),) + scalar_out,
    grid=grid,
    name="kdn_gain_reduce",
    **params,
  )(*raw, reset, p0)


def gain_forward(
  raw,
  reset,
  p0,
  *,
  diag,
  chunk,
  interpret,
  cfg,
  save_pprev=True,
  front=None,
  gain_dtype=jnp.float32,
  segmented=True,
):
  """raw: (k [B,T,H,K], log_alpha [B,T,H,K], omega [B,T,H,K] (diag) or [B,T,H] (iso),
  r [B,T,H], mu [H]) in any float dtype, or with `front` (r_min) the pre-activations
  (k, f [B,T,H,K], dt_bias [H,K], A_log [H], omega_raw, r_raw, mu); reset [B,T]; p0 [B,H,L]
  (L = K diag, 1 iso); diag picks the lane formation (_lanes).
  Returns (gain [B,T,H,L] in gain_dtype, p_prev [B,T,H,L] (the backward's residual; None unless
  save_pprev), p_final [B,H,L], log_alpha [B,T,H,K] (front only, else None)), the rest float32."""
  r = raw[-2]
  k = raw[0]
  lanes = p0.shape[-1]
  bsz, t, nh, nc, grid, params = _launch(r, chunk, interpret, cfg, backward=False)
  reset = reset.astype(jnp.int32)
  scalars = not diag  # the iso replay over per-token scalars (iso_replay.py)
  prod, *extra = reduce_maps(
    raw,
    reset,
    p0,
    diag=diag,
    chunk=chunk,
    interpret=interpret,
    cfg=cfg,
    front=front,
    segmented=segmented,
    scalars=scalars,
  )
  if scalars:  # the replay over per-token scalars (iso_replay.py)
    a, kk, *la = extra
    gain, pprev, pfin = iso_replay.replay(
      a,
      kk,
      raw[-3],
      r,
      raw[-1],
      reset,
      p0,
      prod,
      chunk=chunk,
      kd=k.shape[-1],
      save_pprev=save_pprev,
      front=front,
      data_dtype=k.dtype,
      gain_dtype=gain_dtype,
      segmented=segmented,
      params=params,
    )
    return gain, pprev, pfin, (la[0] if la else None)
  lane = jax.ShapeDtypeStruct((bsz, t, nh, lanes), jnp.float32)
  la_out = _log_alpha_out(k, front)
  outs = pl.pallas_call(
    functools.partial(
      _replay_kernel,
      chunk=chunk,
      num_chunks=nc,
      diag=diag,
      save_pprev=save_pprev,
      front=front,
      segmented=segmented,
    ),
    out_shape=(jax.ShapeDtypeStruct(lane.shape, gain_dtype),)
    + la_out
    + ((lane,) if save_pprev else ())
    + (jax.ShapeDtypeStruct((bsz, nh, lanes), jnp.float32),),
    grid=grid,
    name="kdn_gain_replay",
    **params,
  )(*raw, reset, p0, prod)
  gain, outs = outs[0], outs[1:]
  la, outs = (None, outs) if front is None else (outs[0], outs[1:])
  pprev, pfin = outs if save_pprev else (None, outs[0])
  return gain, pprev, pfin, la


def gain_backward(
  raw,
  reset,
  pprev,
  dgain,
  dpfin,
  *,
  diag,
  chunk,
  interpret,
  cfg,
  front=None,
  dla_out=None,
  dk_dtype=jnp.float32,
  segmented=True,
):
  """Returns the gradients of the raw inputs (k's in dk_dtype, the others' in their dtypes; mu's
  per token, [B,T,H], fp32) and of p0 (fp32). With `front`, `dla_out` is the cotangent of the
  log_alpha the forward emitted, and the per-token gradients are (k, f, omega_raw, r_raw, mu),
  followed by dp0, dt_bias [B,H,K] and A_log [B,H] (summed over chunks here, over the batch by
  the caller)."""
  r = raw[-2]
  k = raw[0]
  lanes = pprev.shape[-1]
  bsz, t, nh, nc, grid, params = _launch(r, chunk, interpret, cfg, backward=True)
  reset = reset.astype(jnp.int32)
  maps = pl.pallas_call(
    functools.partial(_bwd_reduce_kernel, chunk=chunk, diag=diag, front=front, segmented=segmented),
    out_shape=jax.ShapeDtypeStruct((bsz, nh, nc, 2, lanes), jnp.float32),
    grid=grid,
    name="kdn_gain_bwd_reduce",
    **params,
  )(*raw, pprev, dgain, reset)
  per_token = jax.ShapeDtypeStruct(r.shape, jnp.float32)
  dk_shape = jax.ShapeDtypeStruct(k.shape, dk_dtype)
  same = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  if front is None:  # log_alpha, omega, r: in their dtypes (stored once, no cast pass)
    d_shapes = (dk_shape,) + tuple(same(x) for x in raw[1:4]) + (per_token,)
    extra_out = ()
  else:
    # f, omega_raw, r_raw: the gradients go straight to the projections, in their dtype
    d_shapes = (dk_shape,) + tuple(same(raw[i]) for i in (1, 4, 5)) + (per_token,)
    extra_out = (jax.ShapeDtypeStruct((bsz, nh, nc, k.shape[-1]), jnp.float32),) * 2
  extra_in = () if front is None else (dla_out,)
  outs = pl.pallas_call(
    functools.partial(
      _bwd_replay_kernel, chunk=chunk, num_chunks=nc, diag=diag, front=front, segmented=segmented
    ),
    out_shape=d_shapes + (jax.ShapeDtypeStruct((bsz, nh, nc, lanes), jnp.float32),) + extra_out,
    grid=grid,
    name="kdn_gain_bwd_replay",
    **params,
  )(*raw, pprev, dgain, reset, maps, dpfin, *extra_in)
  d_raw, dp0 = outs[:5], outs[5].sum(axis=2)
  if front is None:
    return tuple(d_raw), dp0
  # dt_bias / A_log: sums over chunks here; over batch (and A_log's K) outside the shards
  return tuple(d_raw), dp0, outs[6].sum(axis=2), outs[7].sum(axis=(2, 3))
