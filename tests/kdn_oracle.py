"""Plain float64 token loops: the ground truth the tests hold every
implementation to. Written independently of kdn_jax (explicit matrices,
precision-form posterior), to be run under `jax.enable_x64(True)`."""

import jax
import jax.numpy as jnp


def _starts(segment_ids, b, t):
  if segment_ids is None:
    return jnp.zeros((t, b), bool)
  s = jnp.asarray(segment_ids)
  return jnp.concatenate([jnp.zeros((b, 1), bool), s[:, 1:] != s[:, :-1]], axis=1).T


def _reset(flag, x, x0):
  return jnp.where(flag.reshape(flag.shape + (1,) * (x.ndim - 1)), x0, x)


def _memory_update(S, k, v, la, w):
  """S_t = (I - w k^T) D S + w v^T with explicit K x K matrices."""
  kd = S.shape[-2]
  d = jnp.exp(la)
  d = d if d.ndim == S.ndim - 1 else d[..., None] * jnp.ones(kd)
  e = jnp.eye(kd) - w[..., :, None] * k[..., None, :]
  return e @ (d[..., :, None] * S) + w[..., :, None] * v[..., None, :]


def delta_rule(q, k, v, la, w, S0, scale, segment_ids=None, every=False):
  """Returns (o [B,T,H,V], S_T); every=True: (o, S after every token
  [B,T,H,K,V]), entry t - 1 being S_T of the loop on the first t tokens."""
  b, t = q.shape[:2]
  tm = lambda x: jnp.moveaxis(x, 1, 0)

  def step(S, x):
    st, qt, kt, vt, lat, wt = x
    S = _memory_update(_reset(st, S, S0), kt, vt, lat, wt)
    o = scale * jnp.einsum("bhkv,bhk->bhv", S, qt)
    return S, ((o, S) if every else o)

  S, ys = jax.lax.scan(step, S0, (_starts(segment_ids, b, t), tm(q), tm(k), tm(v), tm(la), tm(w)))
  if every:
    return jnp.moveaxis(ys[0], 0, 1), jnp.moveaxis(ys[1], 0, 1)
  return jnp.moveaxis(ys, 0, 1), S


def kdn(q, k, v, la, omega, r, S0, p0, mu, scale, diag, segment_ids=None, every=False):
  """Diagonal (diag=True) or isotropic KDN. Returns (o, S_T, p_T); every=True:
  (o, S, p) after every token ([B,T,...], like delta_rule's)."""
  b, t = q.shape[:2]
  kd = q.shape[-1]
  tm = lambda x: jnp.moveaxis(x, 1, 0)
  mu = jnp.asarray(mu) * jnp.ones(q.shape[2])

  def step(carry, x):
    st, qt, kt, vt, lat, omt, rt = x
    S, p = _reset(st, carry[0], S0), _reset(st, carry[1], p0)
    if diag:
      p_hat = jnp.exp(2 * lat) * p + omt
      gain = p_hat * kt / (rt + jnp.sum(p_hat * kt**2, -1))[..., None]
      p = p_hat * rt[..., None] / (rt[..., None] + mu[:, None] * kt**2 * p_hat)
    else:
      p_hat = jnp.mean(jnp.exp(2 * lat), -1) * p + omt
      k2 = jnp.sum(kt**2, -1)
      gain = (p_hat / (rt + p_hat * k2))[..., None] * kt
      p = p_hat * kd * rt / (kd * rt + mu * k2 * p_hat)
    S = _memory_update(S, kt, vt, lat, gain)
    o = scale * jnp.einsum("bhkv,bhk->bhv", S, qt)
    return (S, p), ((o, S, p) if every else o)

  (S, p), ys = jax.lax.scan(
    step, (S0, p0), (_starts(segment_ids, b, t), tm(q), tm(k), tm(v), tm(la), tm(omega), tm(r))
  )
  if every:
    return tuple(jnp.moveaxis(y, 0, 1) for y in ys)
  return jnp.moveaxis(ys, 0, 1), S, p


def mobius_sequential(a, b, c, d, x0):
  """x_t = (a x + b)/(c x + d) along axis 0, a Python loop (numpy inputs)."""
  out, x = [], x0
  for t in range(a.shape[0]):
    x = (a[t] * x + b[t]) / (c[t] * x + d[t])
    out.append(x)
  return out
