"""The KDN variance recurrences (docs/math.md sections 2-4): token steps and scans.

Diagonal (per channel i):  p_hat = alpha^2 p + omega,  p = p_hat / (1 + u p_hat),
                           u = mu k^2 / r.
Isotropic (per head):      b_hat = mean(alpha^2) b + omega,
                           b = b_hat / (1 + u b_hat),  u = mu ||k||^2 / (K r).
Both are Moebius maps M = [[s, omega], [u s, 1 + u omega]] (s the squared
decay), so all posteriors come from one `mobius.prefix_products`; the gain
needs the prior p_hat_t, which uses the EXCLUSIVE prefix p_{t-1}.
"""

import functools

import jax
import jax.numpy as jnp

from kdn_jax.ops import diag_gain_grad, mobius
from kdn_jax.ops.varying import all_varying, like_varying


def diag_gain_terms(k, log_alpha, r, info_scale):
  """Per-token (squared decay, information u) for the diagonal variance."""
  return jnp.exp(2.0 * log_alpha), info_scale * k * k / r[..., None]


def iso_gain_terms(k, log_alpha, r, info_scale):
  """Per-token (mean squared decay, information u) for the isotropic variance."""
  key_dim = k.shape[-1]
  decay2 = jnp.mean(jnp.exp(2.0 * log_alpha), axis=-1)
  k2 = jnp.sum(k * k, axis=-1)
  return decay2, info_scale * k2 / (key_dim * r)


def _posterior(prior, u):
  return prior / (1.0 + u * prior)


def diag_variance_step(p, k, log_alpha, omega, r, info_scale):
  """One diagonal step. Shapes [..., K] (r: [...]). Returns (kappa, p_hat, p)."""
  decay2, u = diag_gain_terms(k, log_alpha, r, info_scale)
  p_hat = decay2 * p + omega
  kappa = p_hat * k / (r + jnp.sum(p_hat * k * k, axis=-1))[..., None]
  return kappa, p_hat, _posterior(p_hat, u)


def iso_variance_step(b, k, log_alpha, omega, r, info_scale):
  """One isotropic step. k, log_alpha [..., K]; b, omega, r [...].

  Returns (beta, b_hat, b); the gain vector is beta * k.
  """
  decay2, u = iso_gain_terms(k, log_alpha, r, info_scale)
  b_hat = decay2 * b + omega
  beta = b_hat / (r + b_hat * jnp.sum(k * k, axis=-1))
  return beta, b_hat, _posterior(b_hat, u)


def segment_starts(segment_ids):
  """[B, T] bool: True where a new segment begins (never at t = 0)."""
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return segment_ids != prev


GAIN_CHUNK = 16  # measured fastest forward+backward on CPU (16 vs 32, 64)


def _chunked_posteriors(m, p0, chunk):
  """Posteriors of the Moebius maps m (time on axis 1) from p0.

  The paper's gain schedule: reduce each chunk of `chunk` tokens with a short
  sequential scan (local prefix products), combine the chunk totals with an
  associative scan into exclusive carries, then replay. Work O(T), depth
  chunk + log(T / chunk), and a compile time that does not grow with T.
  """
  t_len = m[0].shape[1]
  chunk = min(chunk, t_len)
  n = -(-t_len // chunk)
  pad = n * chunk - t_len
  ident = (1.0, 0.0, 0.0, 1.0)
  if pad:
    m = tuple(
      jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=e)
      for x, e in zip(m, ident)
    )
  # [B, N*C, ...] -> [C, B, N, ...] so the in-chunk scan runs over axis 0.
  m = tuple(jnp.moveaxis(x.reshape(x.shape[:1] + (n, chunk) + x.shape[2:]), 2, 0) for x in m)
  one = tuple(like_varying(jnp.full(m[0].shape[1:], e, m[0].dtype), m[0]) for e in ident)
  p0 = like_varying(p0, m[0])

  def step(carry, mt):
    carry = mobius.compose(carry, mt)
    return carry, carry

  _, local = jax.lax.scan(step, one, m)
  totals = tuple(x[-1] for x in local)
  incl = mobius.prefix_products(totals, axis=1)
  excl = tuple(jnp.concatenate([o[:, :1], x[:, :-1]], axis=1) for o, x in zip(one, incl))
  p_start = mobius.apply(excl, p0[:, None])
  post = mobius.apply(local, p_start[None])  # [C, B, N, ...]
  post = jnp.moveaxis(post, 0, 2)
  return post.reshape(post.shape[:1] + (n * chunk,) + post.shape[3:])[:, :t_len]


def _variance_scan(decay2, omega, u, p0, starts, chunk=GAIN_CHUNK):
  """Prior and posterior for every token; time on axis 1.

  decay2, omega, u: [B, T, H(, K)]; p0: [B, H(, K)]; starts: [B, T] or None.
  At a segment start the variance is reset to p0 before the token: the token
  map is composed with the constant map x -> p0, i.e. [[0, p0], [0, 1]].
  """
  a, b = decay2, omega
  c, d = u * decay2, 1.0 + u * omega
  p0b = jnp.broadcast_to(p0[:, None], a.shape)
  if starts is not None:
    st = starts.reshape(starts.shape + (1,) * (a.ndim - 2))
    zero = jnp.zeros_like(a)
    a, b, c, d = (
      jnp.where(st, zero, a),
      jnp.where(st, a * p0b + b, b),
      jnp.where(st, zero, c),
      jnp.where(st, c * p0b + d, d),
    )
  post = _chunked_posteriors((a, b, c, d), p0, chunk)
  prev = jnp.concatenate([p0b[:, :1], post[:, :-1]], axis=1)
  if starts is not None:
    prev = jnp.where(st, p0b, prev)
  prior = decay2 * prev + omega
  return prior, post


def diag_variance_scan(k, log_alpha, omega, r, info_scale, p0, segment_ids=None):
  """Diagonal KDN variance for all tokens.

  k, log_alpha, omega: [B, T, H, K]; r: [B, T, H]; info_scale: scalar or [H];
  p0: [B, H, K]. Returns (p_hat, p), both [B, T, H, K]: the prior used by the
  gain and the posterior.
  """
  mu = jnp.asarray(info_scale, k.dtype)
  mu = mu[:, None] if mu.ndim == 1 else mu
  decay2, u = diag_gain_terms(k, log_alpha, r, mu)
  starts = None if segment_ids is None else segment_starts(segment_ids)
  return _variance_scan(decay2, omega, u, p0, starts)


def iso_variance_scan(k, log_alpha, omega, r, info_scale, b0, segment_ids=None):
  """Isotropic KDN variance for all tokens.

  k, log_alpha: [B, T, H, K]; omega, r: [B, T, H]; b0: [B, H].
  Returns (b_hat, b), both [B, T, H].
  """
  mu = jnp.asarray(info_scale, k.dtype)
  decay2, u = iso_gain_terms(k, log_alpha, r, mu)
  starts = None if segment_ids is None else segment_starts(segment_ids)
  return _variance_scan(decay2, omega, u, b0, starts)


def _with_posteriors_at(out, post, at):
  """`at`: None, or a tuple of positions p (the posterior after token p - 1 is
  appended to `out`, [B, P, ...])."""
  if at is None:
    return out
  return out + (jnp.take(post, jnp.asarray(at) - 1, axis=1),)


def _diag_gain_forward(k, log_alpha, omega, r, mu, p0, starts):
  decay2, u = diag_gain_terms(k, log_alpha, r, mu)
  p_hat, p = _variance_scan(decay2, omega, u, p0, starts)
  return p_hat * k / (r + jnp.sum(p_hat * k * k, axis=-1))[..., None], p


@jax.custom_vjp
def _diag_gain_posteriors(k, log_alpha, omega, r, mu, p0, starts):
  """(kappa, every posterior p), both [B, T, H, K]; mu a scalar or [H, 1]."""
  return _diag_gain_forward(k, log_alpha, omega, r, mu, p0, starts)


def _diag_gain_fwd(k, log_alpha, omega, r, mu, p0, starts):
  kappa, p = _diag_gain_forward(k, log_alpha, omega, r, mu, p0, starts)
  # (the backward's only saved array beyond the inputs: the posteriors; diag_gain_grad.py)
  return (kappa, p), (k, log_alpha, omega, r, mu, p0, starts, p)


def _diag_gain_bwd(res, cts):
  *inputs, starts, p = res
  grads = diag_gain_grad.diag_gain_bwd(*inputs, starts, p, *cts)
  return grads + (None,)


_diag_gain_posteriors.defvjp(_diag_gain_fwd, _diag_gain_bwd)


@functools.partial(jax.jit, static_argnames="at")
def diag_gain(k, log_alpha, omega, r, info_scale, p0, segment_ids=None, at=None):
  """kappa [B,T,H,K] and the final variance [B,H,K] via the Moebius scan
  (with `at`, positions as a tuple, also the variance after each)."""
  mu = jnp.asarray(info_scale, k.dtype)
  mu = mu[:, None] if mu.ndim == 1 else mu
  starts = None if segment_ids is None else segment_starts(segment_ids)
  args = all_varying(k, log_alpha, omega, r, mu, p0)
  kappa, p = _diag_gain_posteriors(*args, starts)
  return _with_posteriors_at((kappa, p[:, -1]), p, at)


@functools.partial(jax.jit, static_argnames="at")
def iso_gain(k, log_alpha, omega, r, info_scale, b0, segment_ids=None, at=None):
  """beta [B,T,H] (gain = beta k) and the final variance [B,H] (with `at`,
  also the variance after each of those positions)."""
  b_hat, b = iso_variance_scan(k, log_alpha, omega, r, info_scale, b0, segment_ids)
  beta = b_hat / (r + b_hat * jnp.sum(k * k, axis=-1))
  return _with_posteriors_at((beta, b[:, -1]), b, at)


__all__ = [
  "diag_variance_step",
  "iso_variance_step",
  "diag_variance_scan",
  "iso_variance_scan",
  "diag_gain",
  "iso_gain",
  "segment_starts",
]
