"""Every op and impl against the float64 token loop: outputs and final states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_cases import FAMILIES, make_inputs, make_state, oracle, rel_err, round_f32, run

from kdn_jax import ops

IMPLS = ("reference", "chunked", "pallas")
B, H, K, V = 2, 2, 32, 16  # K != V, B*H > 1, widths the Pallas kernels take
# Pallas runs in interpret mode on CPU (~1 s a call): it gets one length inside
# its first chunk and one crossing chunk edges (chunk 16) with a partial last
# chunk, not every length.
LENGTHS = {"reference": (1, 7, 64, 65, 300), "chunked": (1, 7, 64, 65, 300), "pallas": (1, 40)}


def check(family, x, impl, *, state=None, segment_ids=None, chunk_size=32, tol=1e-5, jit=False):
  x = round_f32(x)
  o, final = run(
    family, x, impl, state=state, segment_ids=segment_ids, chunk_size=chunk_size, jit=jit
  )
  o_ref, final_ref = oracle(family, x, state=state, segment_ids=segment_ids)
  assert np.all(np.isfinite(o)) and all(np.all(np.isfinite(f)) for f in final)
  assert rel_err(o, o_ref) <= tol, ("output", rel_err(o, o_ref))
  for name, f, f_ref in zip(("memory", "variance"), final, final_ref):
    assert rel_err(f, f_ref) <= tol, (name, rel_err(f, f_ref))


@pytest.mark.parametrize("impl,t", [(i, t) for i in IMPLS for t in LENGTHS[i]])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_token_loop(family, impl, t):
  x = make_inputs(family, B, t, H, K, V, seed=t)
  if impl != "pallas":  # the default initial state is built before any impl
    check(family, x, impl)
  check(family, x, impl, state=make_state(family, B, H, K, V))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_segments_match_token_loop(family, impl):
  t = 70
  x = make_inputs(family, B, t, H, K, V, seed=3)
  seg = np.zeros((B, t), np.int32)
  seg[0, 5:40], seg[0, 40:41], seg[0, 41:] = 1, 2, 3  # boundaries inside chunks
  seg[1, 33:] = 1
  check(family, x, impl, state=make_state(family, B, H, K, V), segment_ids=jnp.asarray(seg))


# Head widths the Pallas kernels do not take as they are (ops/widths.py pads K and V and splits V
# into tiles of 256) and the widest they take: every impl meets each of K, V in {8, 48, 96, 256}
# once, each family another pair, across a chunk edge. Pallas (interpret mode): the diag gain
# padded, the iso gain padded (its mean over K), per-channel and scalar decays, K = 256 in key
# tiles (the wide widths' gradients: test_ops_grad.py, test_wide_heads_match_token_loop).
WIDTHS = ((8, 96), (48, 256), (96, 8), (256, 48))
WIDTH_CASES = [
  (f, impl, WIDTHS[(i + shift) % 4])
  for shift, impl in enumerate(IMPLS[::-1])
  for i, f in enumerate(FAMILIES)
]


@pytest.mark.parametrize("family,impl,widths", WIDTH_CASES)
def test_any_width_matches_token_loop(family, impl, widths):
  kd, vd = widths
  x = make_inputs(family, 1, 20, H, kd, vd, seed=kd + vd)
  check(
    family, x, impl, state=make_state(family, 1, H, kd, vd), chunk_size=16, jit=impl == "pallas"
  )


def test_value_tiles_match_token_loop(monkeypatch):
  """V wider than the widest kernel width runs as column tiles (ops/widths.py): with the
  kernels' widths cut to (16, 32), V = 40 runs as two kernel calls, on 32 columns and on 8
  padded to 16, K = 24 padded to 32; outputs and final states as the loop's."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(pallas_kernels.common, "CHUNK_WIDTHS", (16, 32))
  real, widths_seen = pallas_kernels.delta_rule, []

  def spy(q, k, v, *args, **kwargs):
    widths_seen.append((k.shape[-1], v.shape[-1]))
    return real(q, k, v, *args, **kwargs)

  monkeypatch.setattr(pallas_kernels, "delta_rule", spy)
  x = make_inputs("delta_channel", 1, 20, H, 24, 40, seed=9)
  check(
    "delta_channel", x, "pallas", state=make_state("delta_channel", 1, H, 24, 40), chunk_size=16
  )
  assert widths_seen == [(32, 32), (32, 16)], widths_seen


# Grouped value heads (ops/heads.py): q, k with 2 heads, each serving 2 of the 4 value heads
# (the loop reads q, k repeated so). Pallas once (the heads are repeated before any impl; the
# KDN gains' grouped case on Pallas: test_ops_grad's test_grads_at_any_width_with_grouped_heads).
GROUPED_CASES = [(f, i) for f in FAMILIES for i in ("reference", "chunked")] + [
  ("delta_scalar", "pallas")
]


@pytest.mark.parametrize("family,impl", GROUPED_CASES)
def test_grouped_value_heads_match_token_loop(family, impl):
  x = make_inputs(family, 1, 20, 4, K, V, seed=13, hk=2)
  assert x["q"].shape[2] == x["k"].shape[2] == 2 and x["v"].shape[2] == 4
  check(family, x, impl, state=make_state(family, 1, 4, K, V), chunk_size=16)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_segments_equal_separate_runs(family):
  t1 = t2 = 37  # equal halves share one compiled shape
  x = make_inputs(family, 1, t1 + t2, H, K, V, seed=4)
  state = make_state(family, 1, H, K, V)
  seg = jnp.asarray([[0] * t1 + [1] * t2])
  o, final = run(family, x, "chunked", state=state, segment_ids=seg)
  first = {k: (v[:, :t1] if isinstance(v, np.ndarray) else v) for k, v in x.items()}
  second = {k: (v[:, t1:] if isinstance(v, np.ndarray) else v) for k, v in x.items()}
  o1, _ = run(family, first, "chunked", state=state)
  o2, final2 = run(family, second, "chunked", state=state)
  np.testing.assert_allclose(o, np.concatenate([o1, o2], 1), rtol=1e-5, atol=1e-6)
  for f, f2 in zip(final, final2):
    np.testing.assert_allclose(f, f2, rtol=1e-5, atol=1e-6)


# Not Pallas: a split run equals the whole one once outputs and final states
# match the loop from any initial state, which the tests above hold it to.
@pytest.mark.parametrize("impl", ("reference", "chunked"))
@pytest.mark.parametrize("family", FAMILIES)
def test_continuation(family, impl):
  t, cut = 142, 71  # equal halves share one compiled shape
  x = make_inputs(family, B, t, H, K, V, seed=5)
  state = make_state(family, B, H, K, V)
  o, final = run(family, x, impl, state=state)
  head = {k: (v[:, :cut] if isinstance(v, np.ndarray) else v) for k, v in x.items()}
  tail = {k: (v[:, cut:] if isinstance(v, np.ndarray) else v) for k, v in x.items()}
  o1, mid = run(family, head, impl, state=state)
  o2, final2 = run(family, tail, impl, state=tuple(np.asarray(m) for m in mid))
  np.testing.assert_allclose(o, np.concatenate([o1, o2], 1), rtol=1e-5, atol=1e-6)
  for f, f2 in zip(final, final2):
    np.testing.assert_allclose(f, f2, rtol=1e-5, atol=1e-6)


# (hk 1: grouped value heads, for one family of each gain and decay form)
@pytest.mark.parametrize(
  "family,hk", [(f, H) for f in FAMILIES] + [("iso", 1), ("delta_channel", 1)]
)
def test_decode_steps_equal_parallel(family, hk):
  t = 19
  x = make_inputs(family, B, t, H, K, V, seed=6, hk=hk)
  state = make_state(family, B, H, K, V)
  o, final = run(family, x, "chunked", state=state)
  c = {k: (jnp.asarray(v, jnp.float32) if isinstance(v, np.ndarray) else v) for k, v in x.items()}
  if family in ("diag", "iso"):
    st = ops.KDNState(*(jnp.asarray(s, jnp.float32) for s in state))
    step = jax.jit(
      ops.diag_kdn_step if family == "diag" else ops.iso_kdn_step, static_argnames="info_scale"
    )
    outs = []
    for i in range(t):
      o_t, st = step(
        c["q"][:, i],
        c["k"][:, i],
        c["v"][:, i],
        c["log_alpha"][:, i],
        c["omega"][:, i],
        c["r"][:, i],
        st,
        info_scale=c["mu"],
      )
      outs.append(o_t)
    got_final = (st.memory, st.variance)
  else:
    mem = jnp.asarray(state[0], jnp.float32)
    step = jax.jit(ops.delta_rule_step)
    outs = []
    for i in range(t):
      o_t, mem = step(
        c["q"][:, i], c["k"][:, i], c["v"][:, i], c["log_alpha"][:, i], c["write"][:, i], mem
      )
      outs.append(o_t)
    got_final = (mem,)
  np.testing.assert_allclose(np.stack(outs, 1), o, rtol=1e-5, atol=1e-6)
  for f, f2 in zip(got_final, final):
    np.testing.assert_allclose(f, f2, rtol=1e-5, atol=1e-6)


EDGE_CASES = {
  "hard_reset": dict(la_value=-1e4),
  "no_decay": dict(la_value=0.0),
  "strong_decay": dict(la_value=-20.0),
  "tiny_r": dict(r=1e-4),
  "huge_r": dict(r=1e4),
  "mu_1": dict(mu=1.0),
  "mu_4k": dict(mu=4.0 * K),
  "omega_zero": dict(omega_zero=True),
  "omega_zero_hard_reset": dict(omega_zero=True, la_value=-1e4),
}


DECAY_CASES = ("hard_reset", "no_decay", "strong_decay")
EDGE_PARAMS = [
  (f, c) for f in FAMILIES for c in sorted(EDGE_CASES) if f in ("diag", "iso") or c in DECAY_CASES
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family,case", EDGE_PARAMS)
def test_edge_cases(family, case, impl):
  x = make_inputs(family, B, 97, H, K, V, seed=7, **EDGE_CASES[case])
  # Long undecayed delta-rule runs accumulate float32 rounding in the state.
  # Pallas: one trace per family serves all its cases (same shapes).
  check(family, x, impl, state=make_state(family, B, H, K, V), tol=2e-5, jit=impl == "pallas")


def test_wrappers_match_delta_rule():
  b, t, h, kd, vd = 2, 40, 2, 16, 8
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = n(b, t, h, kd), n(b, t, h, kd) / 4, n(b, t, h, vd)
  g_c, g_s = -jax.nn.softplus(n(b, t, h, kd)), -jax.nn.softplus(n(b, t, h))
  beta = jax.nn.sigmoid(n(b, t, h))
  bk, wv = jax.nn.sigmoid(n(b, t, h, kd)), jax.nn.sigmoid(n(b, t, h, vd))
  dr = lambda *a: ops.delta_rule(*a, impl="reference")[0]
  pairs = [
    (ops.kda(q, k, v, g_c, beta, impl="chunked")[0], dr(q, k, v, g_c, beta[..., None] * k)),
    (
      ops.gated_delta_rule(q, k, v, g_s, beta, impl="chunked")[0],
      dr(q, k, v, g_s, beta[..., None] * k),
    ),
    (
      ops.delta_net(q, k, v, beta, impl="chunked")[0],
      dr(q, k, v, jnp.zeros((b, t, h)), beta[..., None] * k),
    ),
    (ops.gdn2(q, k, v, g_c, bk, wv, impl="chunked")[0], dr(q, bk * k, wv * v, g_c, k)),
    (ops.gla(q, k, v, g_c, impl="chunked")[0], dr(q, jnp.zeros_like(k), v, g_c, k)),
  ]
  for got, want in pairs:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # GLA really is the un-erased recurrence S = D S + k v^T.
  s = np.zeros((b, h, kd, vd))
  gq, gk, gv, gg = map(np.asarray, (q, k, v, g_c))
  outs = []
  for i in range(t):
    s = np.exp(gg[:, i])[..., None] * s + gk[:, i, ..., None] * gv[:, i, :, None, :]
    outs.append(np.einsum("bhkv,bhk->bhv", s, gq[:, i]) * kd**-0.5)
  np.testing.assert_allclose(pairs[-1][0], np.stack(outs, 1), rtol=1e-4, atol=1e-5)


def _baseline_inputs(b, t, h, kd, vd, seed):
  rng = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return dict(
    q=n(b, t, h, kd),
    k=n(b, t, h, kd) / 4,
    v=n(b, t, h, vd),
    g_c=-jax.nn.softplus(n(b, t, h, kd)),
    g_s=-jax.nn.softplus(n(b, t, h)),
    beta=jax.nn.sigmoid(n(b, t, h)),
    bk=jax.nn.sigmoid(n(b, t, h, kd)),
    wv=jax.nn.sigmoid(n(b, t, h, vd)),
  )


# op -> (parallel, decode step, its gate arguments after q, k, v)
BASELINES = {
  "kda": (ops.kda, ops.kda_step, ("g_c", "beta")),
  "gated_delta_rule": (ops.gated_delta_rule, ops.gated_delta_rule_step, ("g_s", "beta")),
  "delta_net": (ops.delta_net, ops.delta_net_step, ("beta",)),
  "gdn2": (ops.gdn2, ops.gdn2_step, ("g_c", "bk", "wv")),
  "gla": (ops.gla, ops.gla_step, ("g_s",)),
}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baseline_decode_steps_equal_parallel(name):
  """Stepping a baseline's *_step through T tokens from an initial state gives
  the parallel op's outputs and final state (the same [B, H, K, V] layout)."""
  b, t, h, kd, vd = 2, 13, 2, 16, 8
  parallel, step, gates = BASELINES[name]
  x = _baseline_inputs(b, t, h, kd, vd, seed=len(name))
  s0 = 0.3 * jnp.asarray(np.random.default_rng(1).standard_normal((b, h, kd, vd)), jnp.float32)
  args = [x[n] for n in ("q", "k", "v") + gates]
  o, final = parallel(*args, initial_state=s0, output_final_state=True, impl="chunked")
  step = jax.jit(step)
  mem, outs = s0, []
  for i in range(t):
    o_t, mem = step(*(a[:, i] for a in args), mem)
    outs.append(o_t)
  assert mem.shape == final.shape == (b, h, kd, vd)
  np.testing.assert_allclose(np.stack(outs, 1), o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mem, final, rtol=1e-5, atol=1e-5)


def test_baselines_take_grouped_value_heads():
  """Every named member and its decode step with q, k of one head serving both value heads
  (ops/heads.py; the gates, like v, per value head) equal themselves with q, k repeated to two
  heads (the float64 loop holds the repeated form: test_grouped_value_heads_match_token_loop)."""
  b, t, h, kd, vd = 1, 12, 2, 16, 8
  x = _baseline_inputs(b, t, h, kd, vd, seed=5)
  s0 = jnp.zeros((b, h, kd, vd))
  for name, (parallel, step, gates) in sorted(BASELINES.items()):
    grouped = [x["q"][:, :, :1], x["k"][:, :, :1], x["v"]] + [x[g] for g in gates]
    repeated = [jnp.repeat(a, h, axis=2) for a in grouped[:2]] + grouped[2:]
    got, want = (
      parallel(*a, initial_state=s0, output_final_state=True, impl="chunked")
      for a in (grouped, repeated)
    )
    got_step, want_step = (step(*(z[:, 0] for z in a), s0) for a in (grouped, repeated))
    for g, w in zip(got + got_step, want + want_step):
      assert g.shape == w.shape, name
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=name)
