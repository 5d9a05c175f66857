"""Shared inputs and runners for the ops tests: one test body, every impl."""

import jax
import jax.numpy as jnp
import kdn_oracle
import numpy as np

from kdn_jax import ops

FAMILIES = ("diag", "iso", "delta_channel", "delta_scalar")


def make_inputs(
  family,
  b,
  t,
  h,
  kd,
  vd,
  seed=0,
  *,
  la_scale=1.0,
  r=None,
  mu=None,
  omega_zero=False,
  la_value=None,
  hk=None,
):
  """float64 numpy inputs for one family (unit-norm keys, as layers use).

  hk: q/k heads (default h); fewer than h is grouped value heads (h a multiple
  of hk): q and k get hk heads, everything else h."""
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s)
  hk = h if hk is None else hk
  k = n(b, t, hk, kd)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q = n(b, t, hk, kd)
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  x = dict(q=q, k=k, v=n(b, t, h, vd))
  k = to_value_heads(k, h)
  la_shape = (b, t, h) if family == "delta_scalar" else (b, t, h, kd)
  la = -la_scale * np.log1p(np.exp(n(*la_shape) - 1.0))
  x["log_alpha"] = la if la_value is None else np.full(la_shape, la_value)
  if family in ("diag", "iso"):
    om_shape = (b, t, h, kd) if family == "diag" else (b, t, h)
    x["omega"] = 0.0 * n(*om_shape) if omega_zero else 0.1 * np.log1p(np.exp(n(*om_shape)))
    x["r"] = np.full((b, t, h), r) if r is not None else 0.01 + np.log1p(np.exp(n(b, t, h)))
    x["mu"] = float(kd) if mu is None else mu
  else:
    x["write"] = 0.5 * k * (1 / (1 + np.exp(-n(b, t, h))))[..., None] + 0.1 * n(
      b, t, h, kd
    ) / np.sqrt(kd)
  return x


def to_value_heads(x, h):
  """x [B, T, H_k, ...] with each q/k head repeated for its group of h // H_k
  value heads (heads.py's convention: value head j reads head j // G)."""
  return np.repeat(x, h // x.shape[2], axis=2)


def make_state(family, b, h, kd, vd, seed=1):
  rng = np.random.default_rng(seed)
  s = 0.3 * rng.standard_normal((b, h, kd, vd))
  if family == "diag":
    return (s, 0.2 + rng.random((b, h, kd)))
  if family == "iso":
    return (s, 0.2 + rng.random((b, h)))
  return (s,)


def run(
  family, x, impl, *, state=None, segment_ids=None, chunk_size=32, dtype=jnp.float32, jit=False
):
  """Runs kdn_jax on inputs x cast to dtype; returns (o, final tuple).

  jit=True traces once per (family, impl, shapes): worth it where a test calls
  Pallas (interpret mode, ~1 s a call eagerly) on many same-shape inputs.
  """
  c = {key: jnp.asarray(val, dtype) for key, val in x.items() if key != "mu"}
  st = None if state is None else tuple(jnp.asarray(s, dtype) for s in state)
  fn = _run_jit if jit else _run
  return fn(family, c, x.get("mu"), st, segment_ids, impl, chunk_size)


def _run(family, c, mu, state, segment_ids, impl, chunk_size):
  kw = dict(impl=impl, output_final_state=True, segment_ids=segment_ids, chunk_size=chunk_size)
  if family in ("diag", "iso"):
    fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
    init = None if state is None else ops.KDNState(*state)
    o, st = fn(
      c["q"],
      c["k"],
      c["v"],
      c["log_alpha"],
      c["omega"],
      c["r"],
      info_scale=mu,
      initial_state=init,
      **kw,
    )
    return o, (st.memory, st.variance)
  init = None if state is None else state[0]
  o, s = ops.delta_rule(
    c["q"], c["k"], c["v"], c["log_alpha"], c["write"], initial_state=init, **kw
  )
  return o, (s,)


_run_jit = jax.jit(_run, static_argnums=(0, 5, 6))


def oracle(family, x, *, state=None, segment_ids=None):
  """float64 token loop; inputs are rounded through float32 by the caller."""
  with jax.enable_x64(True):
    h = x["v"].shape[2]
    c = {
      key: jnp.asarray(to_value_heads(val, h) if key in ("q", "k") else val, jnp.float64)
      for key, val in x.items()
      if key != "mu"
    }
    b, _, _, kd = c["q"].shape
    vd = c["v"].shape[-1]
    s0 = jnp.zeros((b, h, kd, vd)) if state is None else jnp.asarray(state[0], jnp.float64)
    scale = kd**-0.5
    if family in ("diag", "iso"):
      p0 = (
        jnp.ones((b, h, kd) if family == "diag" else (b, h))
        if state is None
        else jnp.asarray(state[1], jnp.float64)
      )
      o, s, p = _oracle_kdn(
        c["q"],
        c["k"],
        c["v"],
        c["log_alpha"],
        c["omega"],
        c["r"],
        s0,
        p0,
        jnp.asarray(x["mu"], jnp.float64),
        scale,
        family == "diag",
        segment_ids,
      )
      return np.asarray(o), (np.asarray(s), np.asarray(p))
    o, s = _oracle_delta(c["q"], c["k"], c["v"], c["log_alpha"], c["write"], s0, scale, segment_ids)
    return np.asarray(o), (np.asarray(s),)


# (jitted: an eager token loop compiles its scan on every call, ~1 s on CPU)
_oracle_kdn = jax.jit(kdn_oracle.kdn, static_argnums=(9, 10))
_oracle_delta = jax.jit(kdn_oracle.delta_rule, static_argnums=(6,))


def round_f32(x):
  """The float32-rounded copy of the inputs, so the oracle sees what the op sees."""
  return {
    k: (np.asarray(v, np.float32).astype(np.float64) if isinstance(v, np.ndarray) else v)
    for k, v in x.items()
  }


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_kdn_inputs(dtype, seed=0, *, b=1, t=80, h=2, d=64, gate_dtype=jnp.float32):
  """Random diag KDN op inputs (q, k, v in dtype; log_alpha, omega, r in gate_dtype) for tests
  that lower or compile the kernels rather than check values."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q, k, v = (jax.random.normal(x, (b, t, h, d), jnp.float32).astype(dtype) for x in ks[:3])
  la = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, d)))
  om = jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d)))
  r = 1.0 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))
  return (q, k, v) + tuple(x.astype(gate_dtype) for x in (la, om, r))
