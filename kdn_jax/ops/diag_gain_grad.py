"""The backward of the diagonal KDN gain (variance.diag_gain) from its posteriors alone.

Differentiating the chunked Moebius scan keeps every step's 2x2 products and their
renormalisations, a few dozen fp32 [B, T, H, K] arrays per layer held from the forward to the
backward; here the only saved array is the posterior p (docs/decisions.md). Per channel, with
s = alpha^2 and u = mu k^2 / r:

  prior_t = s_t p_{t-1} + omega_t      (p_{t-1} = p0 at t = 0 and at a segment start)
  p_t     = prior_t / e_t,  e_t = 1 + u_t prior_t
  kappa_t = prior_t k_t / n_t,  n_t = r_t + sum_K prior_t k_t^2

so dp_t / dprior_t = 1 / e_t^2 and dp_t / du_t = -p_t^2. The cotangent H_t of p_t then runs
backwards as a first-order linear recurrence,

  H_{t-1} = dP_{t-1} + s_t (dprior_kappa_t + H_t / e_t^2)   (no link into a segment start),

whose factors s_t / e_t^2 lie in [0, 1]: one reverse associative scan, stable for any T.
"""

import jax
import jax.numpy as jnp


def _linear_scan_reverse(a, b):
  """x_t = b_t + a_{t+1} x_{t+1} along axis 1 (x_{T-1} = b_{T-1}), a_t given at t (a_0 unused)."""
  a_next = jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)

  def combine(later, earlier):
    # Element t is the map y -> a_{t+1} y + b_t; the earlier map applies after the later ones.
    m1, c1 = later
    m2, c2 = earlier
    return m2 * m1, m2 * c1 + c2

  _, x = jax.lax.associative_scan(combine, (a_next, b), reverse=True, axis=1)
  return x


def diag_gain_bwd(k, log_alpha, omega, r, mu, p0, starts, post, d_kappa, d_post):
  """Cotangents of (k, log_alpha, omega, r, mu, p0) of the diagonal gain.

  k, log_alpha, omega, post, d_kappa, d_post: [B, T, H, K]; r: [B, T, H]; mu: a scalar or
  [H, 1]; p0: [B, H, K]; starts: [B, T] bool (segment starts) or None. post: the posteriors the
  forward computed; d_post: the cotangent of every posterior (the final variance's included).
  """
  decay2 = jnp.exp(2.0 * log_alpha)
  u = mu * k * k / r[..., None]
  p0b = p0[:, None]
  prev = jnp.concatenate([jnp.broadcast_to(p0b, p0b.shape), post[:, :-1]], axis=1)
  if starts is not None:
    st = starts[..., None, None]
    prev = jnp.where(st, p0b, prev)
  prior = decay2 * prev + omega
  e = 1.0 + u * prior
  # kappa = prior k / n: its cotangent into prior, k and r
  n = r + jnp.sum(prior * k * k, axis=-1)
  kappa = prior * k / n[..., None]
  d_n = -jnp.sum(d_kappa * kappa, axis=-1) / n
  d_prior_kappa = d_kappa * k / n[..., None] + d_n[..., None] * k * k
  d_k = d_kappa * prior / n[..., None] + 2.0 * d_n[..., None] * prior * k
  # the recurrence: H_t, the whole cotangent of p_t
  link = decay2 / (e * e)
  feed = decay2 * d_prior_kappa
  if starts is not None:
    link = jnp.where(st, 0.0, link)
    feed = jnp.where(st, 0.0, feed)
  feed_next = jnp.concatenate([feed[:, 1:], jnp.zeros_like(feed[:, :1])], axis=1)
  h = _linear_scan_reverse(link, d_post + feed_next)
  d_prior = d_prior_kappa + h / (e * e)
  d_u = -h * post * post
  # back to the inputs
  d_log_alpha = 2.0 * decay2 * d_prior * prev
  first = jnp.zeros(post.shape[:2], bool) if starts is None else starts
  first = first.at[:, 0].set(True)
  d_p0 = jnp.sum(jnp.where(first[..., None, None], decay2 * d_prior, 0.0), axis=1)
  d_k = d_k + 2.0 * d_u * mu * k / r[..., None]
  d_r = d_n - jnp.sum(d_u * u, axis=-1) / r
  d_mu = jnp.sum(d_u * k * k / r[..., None], axis=(0, 1) + ((3,) if jnp.ndim(mu) else (2, 3)))
  d_mu = d_mu.reshape(jnp.shape(mu))
  return d_k, d_log_alpha, d_prior, d_r, d_mu, d_p0
