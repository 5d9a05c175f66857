"""The fused Pallas decode step (interpret mode): over many steps with per-row resets to the initial
state, equal to the XLA `*_step` (its reference) and to the float64 token loop, for diag / iso KDN
and the delta-rule family (a given write with scalar decay, KDA's beta write); in-place state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops_cases import make_inputs, make_state, oracle, rel_err, round_f32
from kdn_jax import ops

B, T, H, K, V = 2, 12, 2, 16, 32


def _segments():
  s = np.zeros((B, T), np.int32)
  s[0, 5:], s[0, 9:] = 1, 2     # row 0 restarts twice, row 1 never
  return s


def _steps(family, x, state, mu, seg, impl):
  """Decodes all T tokens with the op's *_step (state reset per row where a segment starts);
  returns (o [B, T, V], final state tuple)."""
  starts = np.concatenate([np.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  tm = lambda a: jnp.moveaxis(jnp.asarray(a, jnp.float32), 1, 0)
  names = {"diag": ["q", "k", "v", "log_alpha", "omega", "r"],
           "iso": ["q", "k", "v", "log_alpha", "omega", "r"],
           "delta_scalar": ["q", "k", "v", "log_alpha", "write"],
           "kda": ["q", "k", "v", "log_alpha", "beta"]}[family]
  xs = [tm(x[n]) for n in names]
  st0 = tuple(jnp.asarray(s, jnp.float32) for s in state)

  def body(st, inp):
    reset, *xt = inp
    st = tuple(jnp.where(reset.reshape((B,) + (1,) * (s.ndim - 1)), s0, s) for s, s0 in zip(st, st0))
    if family in ("diag", "iso"):
      fn = ops.diag_kdn_step if family == "diag" else ops.iso_kdn_step
      o, new = fn(*xt, ops.KDNState(*st), info_scale=mu, impl=impl)
      return tuple(new), o
    fn = ops.kda_step if family == "kda" else ops.delta_rule_step
    o, new = fn(*xt, st[0], impl=impl)
    return (new,), o

  final, o = jax.jit(lambda xs: jax.lax.scan(body, st0, xs))((jnp.asarray(starts.T), *xs))
  return jnp.moveaxis(o, 0, 1), final


@pytest.mark.parametrize("family", ["diag", "iso", "delta_scalar", "kda"])
def test_fused_decode_equals_xla_step_and_token_loop(family):
  base = "delta_channel" if family == "kda" else family
  x = round_f32(make_inputs(base, B, T, H, K, V, seed=7))
  if family == "kda":   # KDA: write = beta k, beta [B, T, H]
    x["beta"] = np.asarray(np.random.default_rng(8).uniform(0.1, 0.9, (B, T, H)), np.float32) * 1.0
    x["write"] = x["beta"][..., None] * x["k"]
  state = round_f32(dict(enumerate(make_state(base, B, H, K, V))))
  state = [state[i] for i in sorted(state)]
  mu = x.get("mu")
  seg = _segments()
  o_p, fin_p = _steps(family, x, state, mu, seg, "pallas")
  o_x, fin_x = _steps(family, x, state, mu, seg, "reference")
  assert rel_err(o_p, o_x) < 1e-6 and all(rel_err(a, b) < 1e-6 for a, b in zip(fin_p, fin_x))
  o_w, fin_w = oracle(base, x, state=state, segment_ids=seg)
  assert rel_err(o_p, o_w) < 2e-6, rel_err(o_p, o_w)
  for a, b in zip(fin_p, fin_w):
    assert rel_err(a, b) < 2e-6, rel_err(a, b)


def test_fused_decode_updates_the_state_in_place():
  """The kernel aliases the state's input and output buffers (with the state donated under jit,
  the update is in place), and bf16 activations give the XLA step's values (its state exactly
  up to fp32 rounding, o within bf16 rounding)."""
  x = make_inputs("diag", B, 1, H, K, V, seed=9)
  mem, var = (jnp.asarray(s, jnp.float32) for s in make_state("diag", B, H, K, V))
  args = [jnp.asarray(x[n][:, 0], jnp.bfloat16) for n in ("q", "k", "v", "log_alpha", "omega", "r")]
  step = jax.jit(lambda st, *a: ops.diag_kdn_step(*a, st, impl="pallas"), donate_argnums=(0,))
  want_o, want = ops.diag_kdn_step(*args, ops.KDNState(mem, var), impl="reference")
  o, new = step(ops.KDNState(mem, var), *args)
  assert o.dtype == jnp.bfloat16 and new.memory.dtype == jnp.float32
  assert rel_err(new.memory, want.memory) < 1e-6 and rel_err(new.variance, want.variance) < 1e-6
  assert rel_err(o.astype(jnp.float32), want_o.astype(jnp.float32)) < 1e-2
  # the kernel writes S' over its memory input (the 9th: q, k, v, la, omega, r, mu, variance, S)
  jaxpr = str(jax.make_jaxpr(lambda st, *a: ops.diag_kdn_step(*a, st, impl="pallas"))(
      ops.KDNState(mem, var), *args))
  assert "input_output_aliases=((8, 1),)" in jaxpr


def test_step_impl_choice():
  x = make_inputs("delta_channel", B, 1, H, 8, 8)
  args = [jnp.asarray(x[n][:, 0], jnp.float32) for n in ("q", "k", "v", "log_alpha", "write")]
  memory = jnp.zeros((B, H, 8, 8))
  with pytest.raises(ValueError, match=r"delta_rule_step: impl='pallas': K \(key width\) = 8"):
    ops.delta_rule_step(*args, memory, impl="pallas")
  o, _ = ops.delta_rule_step(*args, memory, impl="auto")   # auto: the XLA step here
  assert o.shape == (B, H, 8)
  with pytest.raises(ValueError, match="delta_rule_step: write must have shape"):
    ops.delta_rule_step(*args[:4], args[4][..., :3], memory)
