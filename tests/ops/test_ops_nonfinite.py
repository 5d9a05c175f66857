"""Non-finite inputs stay inside their segment, for every impl (kdn_jax/ops/nonfinite.py).

A hypothesis fuzz (no example database) over packed rows with NaN / +inf / -inf written into
any input at any token, and log_alpha = -inf (legal: forget everything) sprinkled in: against
the float64 token loop (tests/kdn_oracle.py), every token outside the reach of a bad value
matches it, every token inside reports NaN (the bad value's own token included), and the final
memory / variance are NaN exactly when the last segment was reached."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ops_cases import FAMILIES, make_inputs, make_state, oracle, rel_err, round_f32, run

from kdn_jax import ops
from kdn_jax.ops import nonfinite

B, T, H = 2, 40, 2
# Inputs of the memory recurrence per family, and those of the KDN variance recurrence.
STATE_INPUTS = {
  "diag": ("k", "v", "log_alpha", "omega", "r"),
  "iso": ("k", "v", "log_alpha", "omega", "r"),
  "delta_channel": ("k", "v", "log_alpha", "write"),
  "delta_scalar": ("k", "v", "log_alpha", "write"),
}
VARIANCE_INPUTS = ("k", "log_alpha", "omega", "r")


def _inputs(rng, family, kd, vd):
  """float32-rounded float64 inputs in the documented domains, log_alpha = -inf at ~8% of
  its entries."""
  nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (nrm(rng.standard_normal((B, T, H, kd))) for _ in range(2))
  x = dict(q=q, k=k, v=rng.standard_normal((B, T, H, vd)))
  la_shape = (B, T, H) if family == "delta_scalar" else (B, T, H, kd)
  la = -3.0 * rng.random(la_shape)
  la[rng.random(la_shape) < 0.08] = -np.inf
  x["log_alpha"] = la
  if family in ("diag", "iso"):
    om_shape = (B, T, H, kd) if family == "diag" else (B, T, H)
    x["omega"] = 0.1 * rng.random(om_shape)
    x["r"] = 10.0 ** rng.uniform(-1, 1, (B, T, H))
    x["mu"] = float(kd)
  else:
    x["write"] = rng.random((B, T, H, 1)) * k
  return round_f32(x)


@st.composite
def cases(draw, families, with_state=None):
  family = draw(st.sampled_from(families))
  names = ("q",) + STATE_INPUTS[family]
  bad = draw(
    st.lists(
      st.tuples(
        st.sampled_from(names),
        st.integers(0, B - 1),
        st.integers(0, T - 1),
        st.integers(0, H - 1),
        st.sampled_from((np.nan, np.inf, -np.inf)),
      ),
      min_size=1,
      max_size=3,
    )
  )
  starts = draw(st.lists(st.integers(1, T - 1), max_size=4))
  with_state = draw(st.booleans()) if with_state is None else with_state
  return dict(
    family=family, bad=bad, starts=starts, with_state=with_state, seed=draw(st.integers(0, 2**16))
  )


def _spoiled(case, seg):
  """What the bad values reach, written independently of the ops: (outputs [B, T, H], final
  memory [B, H], final variance [B, H])."""
  out = np.zeros((B, T, H), bool)
  memory, variance = np.zeros((B, H), bool), np.zeros((B, H), bool)
  for name, b, t, h, value in case["bad"]:
    if name == "log_alpha" and value == -np.inf:
      continue  # legal
    if name == "q":
      out[b, t, h] = True
      continue
    end = t
    while end < T and seg[b, end] == seg[b, t]:
      end += 1
    out[b, t:end, h] = True
    if end == T:
      memory[b, h] = True
      variance[b, h] |= name in VARIANCE_INPUTS
  return out, memory, variance


def _check(impl, case, kd, vd):
  rng = np.random.default_rng(case["seed"])
  fam = case["family"]
  x = _inputs(rng, fam, kd, vd)
  for name, b, t, h, value in case["bad"]:
    x[name][b, t, h] = value  # (every channel of the token: any one would do)
  seg = np.zeros((B, T), np.int32)
  for p in case["starts"]:
    seg[:, p:] += 1
  if len(case["starts"]) % 2:
    seg[1] = 0  # rows packed differently
  state = None
  if case["with_state"]:
    s = [0.3 * rng.standard_normal((B, H, kd, vd))]
    if fam in ("diag", "iso"):
      s.append(10.0 ** rng.uniform(-1, 1, (B, H, kd) if fam == "diag" else (B, H)))
    state = tuple(np.asarray(a, np.float32).astype(np.float64) for a in s)
  segj = jnp.asarray(seg)
  o, final = run(fam, x, impl, state=state, segment_ids=segj, chunk_size=16, jit=True)
  o_ref, final_ref = oracle(fam, x, state=state, segment_ids=segj)
  o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref)
  out, memory, variance = _spoiled(case, seg)
  # Inside the reach: NaN in every impl; the loop is non-finite there too for a NaN.
  assert np.all(np.isnan(o[out])), np.argwhere(out & ~np.isnan(o).all(-1))[:5]
  nan_written = [c for c in case["bad"] if c[4] != c[4]]
  if nan_written and len(nan_written) == len(case["bad"]):
    assert np.all(~np.isfinite(o_ref[out]).any(-1))
  # Outside: the float64 loop's values (finite: the loop contains them too).
  keep = ~out
  assert np.all(np.isfinite(o_ref[keep])) and np.all(np.isfinite(o[keep]))
  assert rel_err(o[keep], o_ref[keep]) <= 1e-4, rel_err(o[keep], o_ref[keep])
  for got, want, spoiled in zip(final, final_ref, (memory, variance)):
    got = np.asarray(got, np.float64)
    assert np.all(np.isnan(got[spoiled]))
    assert rel_err(got[~spoiled], want[~spoiled]) <= 1e-4


FUZZ = dict(deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize("impl", ("reference", "chunked"))
@settings(max_examples=40, **FUZZ)
@given(case=cases(FAMILIES))
def test_nonfinite_values_stay_in_their_segment(impl, case):
  _check(impl, case, kd=8, vd=8)


@settings(max_examples=8, **FUZZ)
@given(case=cases(("diag", "delta_scalar"), with_state=True))
def test_nonfinite_values_stay_in_their_segment_pallas(case):
  """The Pallas kernels (interpret mode) at their smallest width, two families with an initial
  state (one compile each): the guard is the same code for every impl, what differs is the
  kernels' arithmetic."""
  _check("pallas", case, kd=16, vd=16)


def test_minus_inf_decay_is_a_full_forget():
  """log_alpha = -inf everywhere: every token sees only its own write (S_t = w v^T), in each
  impl, with no NaN; its floor's exp is exactly 0 in each dtype."""
  for dtype in (jnp.float32, jnp.float64, jnp.bfloat16):
    floor = nonfinite.log_decay_floor(jnp.float32 if dtype == jnp.bfloat16 else dtype)
    with jax.enable_x64(dtype == jnp.float64):
      assert float(jnp.exp(jnp.asarray(floor, dtype))) == 0.0
      assert float(jnp.asarray(floor, dtype)) == floor  # representable
  rng = np.random.default_rng(0)
  q, k, v, w = (jnp.asarray(rng.standard_normal((1, 24, 1, 16)), jnp.float32) for _ in range(4))
  la = jnp.full((1, 24, 1, 16), -jnp.inf)
  want = jnp.einsum("bthk,bthk->bth", q, w)[..., None] * 0.25 * v
  for impl in ("reference", "chunked", "pallas"):
    o, s = ops.delta_rule(q, k, v, la, w, impl=impl, chunk_size=16, output_final_state=True)
    assert rel_err(o, want) <= 1e-5, (impl, rel_err(o, want))
    assert rel_err(s, w[:, -1, :, :, None] * v[:, -1, :, None, :]) <= 1e-5


def test_checked_mode_domain_edges():
  """checked=True: -inf log_alpha passes; infinite omega, r, mu, initial variance and non-finite
  q / k / v / write / initial memory are named."""
  rng = np.random.default_rng(1)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = n(1, 4, 1, 16), n(1, 4, 1, 16), n(1, 4, 1, 16)
  la = (-jnp.abs(n(1, 4, 1, 16))).at[0, 1].set(-jnp.inf)
  om, r = jnp.abs(n(1, 4, 1, 16)), 1.0 + jnp.abs(n(1, 4, 1))
  st0 = ops.KDNState(jnp.zeros((1, 1, 16, 16)), jnp.ones((1, 1, 16)))
  kw = dict(checked=True, impl="reference", output_final_state=True)
  o, _ = ops.diag_kdn(q, k, v, la, om, r, initial_state=st0, **kw)
  assert np.all(np.isfinite(o))
  bad = [
    (dict(omega=om.at[0, 2, 0, 3].set(jnp.inf)), "diag_kdn: omega must be finite"),
    (dict(r=r.at[0, 0, 0].set(jnp.inf)), "diag_kdn: r must be finite"),
    (dict(info_scale=jnp.inf), "diag_kdn: info_scale must be finite"),
    (
      dict(initial_state=st0._replace(variance=st0.variance.at[0, 0, 2].set(jnp.inf))),
      "diag_kdn: initial_state.variance must be finite",
    ),
    (
      dict(initial_state=st0._replace(memory=st0.memory.at[0, 0, 2].set(jnp.nan))),
      "diag_kdn: initial_state.memory must be finite",
    ),
    (dict(log_alpha=la.at[0, 3, 0, 0].set(jnp.inf)), "diag_kdn: log_alpha must be <= 0"),
    (dict(v=v.at[0, 3, 0, 0].set(-jnp.inf)), "diag_kdn: v must be finite"),
    (dict(q=q.at[0, 0, 0, 0].set(jnp.nan)), "diag_kdn: q must be finite"),
  ]
  args = dict(q=q, k=k, v=v, log_alpha=la, omega=om, r=r, initial_state=st0)
  for change, msg in bad:
    a = dict(args, **change)
    with pytest.raises(ops.InvalidValueError, match=msg):
      ops.diag_kdn(
        a["q"],
        a["k"],
        a["v"],
        a["log_alpha"],
        a["omega"],
        a["r"],
        initial_state=a["initial_state"],
        info_scale=a.get("info_scale"),
        **kw,
      )
  beta = jnp.abs(n(1, 4, 1))
  ops.kda(q, k, v, la, beta, **kw)  # -inf g passes
  with pytest.raises(ops.InvalidValueError, match="kda: beta must be finite"):
    ops.kda(q, k, v, la, beta.at[0, 0, 0].set(jnp.inf), **kw)
  with pytest.raises(ops.InvalidValueError, match="delta_net: k must be finite"):
    ops.delta_net(q, k.at[0, 1, 0, 1].set(jnp.nan), v, beta, **kw)
  with pytest.raises(ops.InvalidValueError, match="delta_rule: write must be finite"):
    ops.delta_rule(q, k, v, la, k.at[0, 1, 0, 1].set(jnp.nan), **kw)
  with pytest.raises(ops.InvalidValueError, match="gla_step: memory must be finite"):
    ops.gla_step(
      q[:, 0], k[:, 0], v[:, 0], la[:, 0], jnp.full((1, 1, 16, 16), jnp.inf), checked=True
    )
  # under jit, through ops.checked: the same message
  fn = functools.partial(ops.diag_kdn, checked=True, impl="reference")
  with pytest.raises(ops.InvalidValueError, match="diag_kdn: omega must be finite"):
    ops.checked(jax.jit(fn))(q, k, v, la, om.at[0, 0, 0, 0].set(jnp.inf), r)


# The ops' fast scheme (check the outputs, fall back to the guarded path) against the guarded
# path run on every call (nonfinite.Guard, scheme "inputs"): outputs, final states and input
# gradients, for clean inputs (with and without log_alpha = -inf and below the floor) and for
# non-finite values of every kind in every input, the initial state included.
EQ_B, EQ_T, EQ_H, EQ_K = 2, 37, 2, 16  # (T not a multiple of the chunk, 16)


@functools.cache
def _vjp_fn(family, impl, scheme, segments):
  """jit of (inputs, state, segment_ids, cotangents) -> (o, finals, gradients) under `scheme`."""

  def f(x, state, seg, ct):
    def op(x, state):
      with nonfinite.scheme(scheme):
        seg_ = seg if segments else None
        kw = dict(impl=impl, chunk_size=16, segment_ids=seg_, output_final_state=True)
        if family in ("diag", "iso"):
          fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
          args = (x["q"], x["k"], x["v"], x["log_alpha"], x["omega"], x["r"])
          o, st = fn(*args, info_scale=float(EQ_K), initial_state=ops.KDNState(*state), **kw)
          return o, (st.memory, st.variance)
        args = (x["q"], x["k"], x["v"], x["log_alpha"], x["write"])
        o, s = ops.delta_rule(*args, initial_state=state[0], **kw)
        return o, (s,)

    out, vjp = jax.vjp(op, x, state)
    return out, vjp(ct)

  return jax.jit(f)


def _eq_inputs(case, dtype):
  rng = np.random.default_rng(case["seed"])
  fam = case["family"]
  x = make_inputs(fam, EQ_B, EQ_T, EQ_H, EQ_K, EQ_K, seed=case["seed"])
  x.pop("mu", None)
  if case["la_special"]:  # (legal, and the fast path leaves them to the fallback)
    x["log_alpha"][rng.random(x["log_alpha"].shape) < 0.05] = -np.inf
    # below the floor but finite: the floor moves it (its gradient is 0 there)
    x["log_alpha"][rng.random(x["log_alpha"].shape) < 0.02] = -1e4
  state = list(make_state(fam, EQ_B, EQ_H, EQ_K, EQ_K, seed=case["seed"] + 1))
  for name, b, t, h, c, value in case["bad"]:
    if name == "memory":
      state[0][b, h, c % EQ_K] = value
    elif name == "variance":
      if fam in ("diag", "iso"):
        state[1][b, h] = value
    elif name in x:
      x[name][b, t, h] = value  # (every channel of the token)
  seg = np.zeros((EQ_B, EQ_T), np.int32)
  for p in case["starts"]:
    seg[0, p:] += 1
  o_shape = (EQ_B, EQ_T, EQ_H, EQ_K)
  ct = rng.standard_normal(o_shape), tuple(rng.standard_normal(s.shape) for s in state)
  cast = lambda a: jnp.asarray(a, dtype)
  return (
    {n: cast(a) for n, a in x.items()},
    tuple(cast(s) for s in state),
    jnp.asarray(seg),
    (cast(ct[0]), tuple(cast(c) for c in ct[1])),
  )


@st.composite
def eq_cases(draw, families):
  names = ("q", "k", "v", "log_alpha", "write", "omega", "r", "memory", "variance")
  value = st.sampled_from((np.nan, np.inf, -np.inf))
  bad = st.tuples(
    st.sampled_from(names),
    st.integers(0, EQ_B - 1),
    st.integers(0, EQ_T - 1),
    st.integers(0, EQ_H - 1),
    st.integers(0, EQ_K - 1),
    value,
  )
  return dict(
    family=draw(st.sampled_from(families)),
    bad=draw(st.lists(bad, min_size=0, max_size=2)),
    starts=draw(st.lists(st.integers(1, EQ_T - 1), max_size=3)),
    segments=True,
    la_special=draw(st.booleans()),
    seed=draw(st.integers(0, 2**16)),
  )


def _assert_fast_equals_guarded(impl, case, dtype=jnp.float32, bitwise=True):
  """The same non-finite entries in every output, final state and gradient; outputs and final
  states bit for bit on clean inputs (the fast path's; `bitwise`: under XLA's full optimisation,
  at its lowest level XLA:CPU rounds the two paths' equal programs an ulp apart); everything else equal up to how XLA
  compiles the same arithmetic in another place (the fallback inside a cond; the gradient's
  terms summed in another order: k and log_alpha feed several stages): ulps."""
  args = _eq_inputs(case, dtype)
  want = _vjp_fn(case["family"], impl, "inputs", case["segments"])(*args)
  got = _vjp_fn(case["family"], impl, "outputs", case["segments"])(*args)
  x, state = args[:2]
  clean = all(
    bool(jnp.all(jnp.isfinite(a) | (a == -jnp.inf if n == "log_alpha" else False)))
    for n, a in [*x.items(), ("state", state[0]), ("state", state[-1])]
  )
  tol = 1e-5 if dtype == jnp.float32 else 1e-12
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    if bitwise and clean and i < len(jax.tree.leaves(got[0])):
      np.testing.assert_array_equal(g, w)
    ok = np.isfinite(w)
    np.testing.assert_allclose(g[ok], w[ok], rtol=tol, atol=tol * max(np.abs(w[ok]).max(), 1e-30))


EQ = dict(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=6, **EQ)
@given(case=eq_cases(("diag", "delta_scalar")))
def test_fast_scheme_equals_the_guarded_path_chunked(optimized_xla, case):
  _assert_fast_equals_guarded("chunked", case)


@settings(max_examples=4, **FUZZ)
@given(case=eq_cases(("diag",)))
def test_fast_scheme_equals_the_guarded_path_pallas(case):
  _assert_fast_equals_guarded("pallas", case, bitwise=False)


@settings(max_examples=5, **FUZZ)
@given(case=eq_cases(("iso", "delta_channel")))
def test_fast_scheme_equals_the_guarded_path_x64(case):
  with jax.enable_x64(True):
    _assert_fast_equals_guarded("chunked", case, jnp.float64, bitwise=False)


def _cond_out_bytes(jaxpr, acc):
  for e in jaxpr.eqns:
    if e.primitive.name == "cond":
      acc.append(sum(v.aval.size * v.aval.dtype.itemsize for v in e.outvars))
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      _cond_out_bytes(sub, acc)
  return acc


@pytest.mark.parametrize("impl", ("chunked", "pallas"))
def test_fast_scheme_passes_no_residuals_through_a_cond(impl):
  """fwd+bwd has one cond in the forward (returning the outputs) and one in the backward
  (returning the gradients): the fallback's residuals are recomputed in the backward, never
  zero-filled on the fast path."""
  x = make_inputs("diag", 1, 20, 2, 16, 16)
  args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "log_alpha", "omega", "r")]

  def loss(*a):
    with nonfinite.scheme("outputs"):
      o, st = ops.diag_kdn(*a, impl=impl, chunk_size=16, output_final_state=True)
    return jnp.sum(o**2) + jnp.sum(st.memory) + jnp.sum(st.variance)

  grad = jax.grad(loss, argnums=tuple(range(6)))
  sizes = [b for b in _cond_out_bytes(jax.make_jaxpr(grad)(*args).jaxpr, []) if b]
  outputs = 4 * (20 * 2 * 16 + 2 * 16 * 16 + 2 * 16)  # o, final memory and variance (fp32)
  # (and of the initial state and mu [H], arguments of the guard's VJP)
  grads = 4 * (sum(a.size for a in args) + 2 * 16 * 16 + 2 * 16 + 2)
  assert sizes == [outputs, grads], sizes


def test_fast_scheme_contains_a_bad_segment_bit_for_bit(optimized_xla):
  """The output-checked Pallas path, one program: NaN / inf in one packed segment leave the outputs and
  input gradients of every other segment bit-identical to the clean run's (which took the fast
  path while the bad run took the fallback), and spoil the whole bad segment. (At XLA's lowest
  optimisation level XLA:CPU rounds the fallback's backward an ulp apart.) On a GPU this runs the
  kernels themselves."""
  b, t, h, kd = 2, 40, 2, 16
  x = make_inputs("diag", b, t, h, kd, kd, seed=3)
  clean = {n: jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "log_alpha", "omega", "r")}
  seg = jnp.asarray(np.repeat([[0] * 15 + [1] * 25], b, 0), jnp.int32)
  ct = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, h, kd)), jnp.float32)

  @jax.jit
  def f(a):
    def op(a):
      args = [a[n] for n in ("q", "k", "v", "log_alpha", "omega", "r")]
      return ops.diag_kdn(*args, impl="pallas", chunk_size=16, segment_ids=seg)[0]

    o, vjp = jax.vjp(op, a)
    return o, vjp(jnp.where(jnp.isfinite(o), ct, 0.0))[0]

  with nonfinite.scheme("outputs"):
    o0, g0 = f(clean)
  keep = np.ones((b, t), bool)
  keep[0, :15] = False
  for name, value in (("k", jnp.nan), ("v", jnp.inf), ("r", jnp.inf)):
    with nonfinite.scheme("outputs"):
      o1, g1 = f(dict(clean, **{name: clean[name].at[0, 5, 1].set(value)}))
    assert np.all(np.isnan(np.asarray(o1)[0, 5:15, 1])), name
    np.testing.assert_array_equal(np.asarray(o1)[keep], np.asarray(o0)[keep])
    for n in g0:
      np.testing.assert_array_equal(np.asarray(g1[n])[keep], np.asarray(g0[n])[keep])
