"""The fused Pallas decode step (interpret mode): over many steps with per-row resets to the initial
state, equal to the XLA `*_step` (its reference) and to the float64 token loop, for diag / iso KDN
and the delta-rule family (a given write with scalar decay, KDA's beta write), with V split over
several programs, in float32 and under x64; in-place state through donation; a non-finite row
leaves the others bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_cases import make_inputs, make_state, oracle, rel_err, round_f32

from kdn_jax import ops
from pallas_kernels import KernelConfigs
from pallas_kernels.decode.config import DecodeConfig

B, T, H, K, V = 2, 12, 2, 16, 32
BLOCK_V = 8  # four V blocks per head: the erase term must stay exact across the split
KC = KernelConfigs(decode=DecodeConfig(block_v=BLOCK_V))


def _segments():
  s = np.zeros((B, T), np.int32)
  s[0, 5:], s[0, 9:] = 1, 2  # row 0 restarts twice, row 1 never
  return s


def _steps(family, x, state, mu, seg, impl, dtype=jnp.float32):
  """Decodes all T tokens with the op's *_step (state reset per row where a segment starts);
  returns (o [B, T, V], final state tuple)."""
  starts = np.concatenate([np.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  tm = lambda a: jnp.moveaxis(jnp.asarray(a, dtype), 1, 0)
  names = {
    "diag": ["q", "k", "v", "log_alpha", "omega", "r"],
    "iso": ["q", "k", "v", "log_alpha", "omega", "r"],
    "delta_scalar": ["q", "k", "v", "log_alpha", "write"],
    "kda": ["q", "k", "v", "log_alpha", "beta"],
  }[family]
  xs = [tm(x[n]) for n in names]
  st0 = tuple(jnp.asarray(s, dtype) for s in state)
  kw = dict(impl=impl, kernel_config=KC)

  def body(st, inp):
    reset, *xt = inp
    st = tuple(
      jnp.where(reset.reshape((B,) + (1,) * (s.ndim - 1)), s0, s) for s, s0 in zip(st, st0)
    )
    if family in ("diag", "iso"):
      fn = ops.diag_kdn_step if family == "diag" else ops.iso_kdn_step
      o, new = fn(*xt, ops.KDNState(*st), info_scale=mu, **kw)
      return tuple(new), o
    fn = ops.kda_step if family == "kda" else ops.delta_rule_step
    o, new = fn(*xt, st[0], **kw)
    return (new,), o

  final, o = jax.jit(lambda xs: jax.lax.scan(body, st0, xs))((jnp.asarray(starts.T), *xs))
  return jnp.moveaxis(o, 0, 1), final


def _case(family):
  """(base family of ops_cases, inputs, state list, mu) of one decode family."""
  base = "delta_channel" if family == "kda" else family
  x = round_f32(make_inputs(base, B, T, H, K, V, seed=7))
  if family == "kda":  # KDA: write = beta k, beta [B, T, H]
    x["beta"] = np.asarray(np.random.default_rng(8).uniform(0.1, 0.9, (B, T, H)), np.float32) * 1.0
    x["write"] = x["beta"][..., None] * x["k"]
  state = round_f32(dict(enumerate(make_state(base, B, H, K, V))))
  return base, x, [state[i] for i in sorted(state)], x.get("mu")


@pytest.mark.parametrize("family", ["diag", "iso", "delta_scalar", "kda"])
def test_fused_decode_equals_xla_step_and_token_loop(family):
  base, x, state, mu = _case(family)
  seg = _segments()
  o_p, fin_p = _steps(family, x, state, mu, seg, "pallas")
  o_x, fin_x = _steps(family, x, state, mu, seg, "reference")
  assert fin_p[0].dtype == jnp.float32
  assert rel_err(o_p, o_x) < 1e-6 and all(rel_err(a, b) < 1e-6 for a, b in zip(fin_p, fin_x))
  o_w, fin_w = oracle(base, x, state=state, segment_ids=seg)
  assert rel_err(o_p, o_w) < 2e-6, rel_err(o_p, o_w)
  for a, b in zip(fin_p, fin_w):
    assert rel_err(a, b) < 2e-6, rel_err(a, b)


@pytest.mark.parametrize("family", ["diag", "iso", "kda"])
def test_fused_decode_under_x64_computes_in_float64(family):
  """float64 inputs under x64: the kernel computes in float64 (not a float32 round trip), so it
  meets the XLA step and the token loop at float64 accuracy."""
  base, x, state, mu = _case(family)
  seg = _segments()
  with jax.enable_x64(True):
    o_p, fin_p = _steps(family, x, state, mu, seg, "pallas", jnp.float64)
    o_x, fin_x = _steps(family, x, state, mu, seg, "reference", jnp.float64)
    assert o_p.dtype == jnp.float64 and all(a.dtype == jnp.float64 for a in fin_p)
    assert rel_err(o_p, o_x) < 1e-12 and all(rel_err(a, b) < 1e-12 for a, b in zip(fin_p, fin_x))
    o_w, fin_w = oracle(base, x, state=state, segment_ids=seg)
    assert rel_err(o_p, o_w) < 1e-10, rel_err(o_p, o_w)
    for a, b in zip(fin_p, fin_w):
      assert rel_err(a, b) < 1e-10, rel_err(a, b)


@pytest.mark.parametrize("family", ["diag", "kda"])
def test_nonfinite_row_leaves_other_rows_bit_identical(family):
  """NaN in one row's v and Inf in its k at one step: every later output and the final state of
  the other rows equal a clean run's bit for bit (each program reads one row)."""
  _, x, state, mu = _case(family)
  seg = np.zeros((B, T), np.int32)
  bad = {n: np.array(a, copy=True) for n, a in x.items()}
  bad["v"][0, 3, 1, 5] = np.nan
  bad["k"][0, 6, 0, 2] = np.inf
  o_clean, fin_clean = _steps(family, x, state, mu, seg, "pallas")
  o_bad, fin_bad = _steps(family, bad, state, mu, seg, "pallas")
  assert not np.all(np.isfinite(np.asarray(o_bad[0])))  # the bad row did see its NaN
  np.testing.assert_array_equal(np.asarray(o_bad[1:]), np.asarray(o_clean[1:]))
  for a, b in zip(fin_bad, fin_clean):
    np.testing.assert_array_equal(np.asarray(a[1:]), np.asarray(b[1:]))


def test_donated_state_is_consumed_and_steps_stay_exact():
  """Under jit with the state donated the step consumes the caller's buffers (the old arrays are
  deleted, so no stale state can be read through them) and, chained over several steps, returns
  the XLA step's state each time."""
  x = make_inputs("diag", B, 4, H, K, V, seed=11)
  mem, var = (jnp.asarray(s, jnp.float32) for s in make_state("diag", B, H, K, V))
  names = ("q", "k", "v", "log_alpha", "omega", "r")
  step = jax.jit(
    lambda st, *a: ops.diag_kdn_step(*a, st, impl="pallas", kernel_config=KC),
    donate_argnums=(0,),
  )
  ref = ops.KDNState(mem, var)
  state = ops.KDNState(jnp.array(mem, copy=True), jnp.array(var, copy=True))
  for t in range(4):
    args = [jnp.asarray(x[n][:, t], jnp.float32) for n in names]
    want_o, ref = ops.diag_kdn_step(*args, ref, impl="reference")
    old = state
    o, state = step(state, *args)
    assert old.memory.is_deleted() and old.variance.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
      np.asarray(old.memory)
    assert rel_err(o, want_o) < 1e-6
    assert rel_err(state.memory, ref.memory) < 1e-6
    assert rel_err(state.variance, ref.variance) < 1e-6


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
  jaxpr = str(
    jax.make_jaxpr(lambda st, *a: ops.diag_kdn_step(*a, st, impl="pallas"))(
      ops.KDNState(mem, var), *args
    )
  )
  assert "input_output_aliases=((8, 1),)" in jaxpr


def test_step_impl_choice():
  x = make_inputs("delta_channel", B, 1, H, 8, 8)
  args = [jnp.asarray(x[n][:, 0], jnp.float32) for n in ("q", "k", "v", "log_alpha", "write")]
  memory = jnp.zeros((B, H, 8, 8))
  with pytest.raises(ValueError, match=r"delta_rule_step: impl='pallas': K \(key width\) = 8"):
    ops.delta_rule_step(*args, memory, impl="pallas")
  o, _ = ops.delta_rule_step(*args, memory, impl="auto")  # auto: the XLA step here
  assert o.shape == (B, H, 8)
  with pytest.raises(ValueError, match="delta_rule_step: write must have shape"):
    ops.delta_rule_step(*args[:4], args[4][..., :3], memory)


@pytest.fixture
def as_on_gpu(monkeypatch):
  from pallas_kernels import common  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(common, "kernel_backend", lambda: "gpu")


def _lower_for_cuda(fn, *args):
  """The MLIR text of fn(*args) lowered for CUDA (Triton IR built, nothing compiled or run): the
  kernels' lowering is checked without a GPU (tests/kernels/test_pallas_lowering.py says why)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_decode_steps_lower_for_cuda(as_on_gpu):
  """Every kind of the fused step at K = V = 128 with bf16 activations."""
  b, h, d = 2, 4, 128
  bf = jnp.bfloat16
  x = [jnp.ones((b, h, d), bf) for _ in range(4)]
  lane, head = jnp.ones((b, h, d), bf), jnp.ones((b, h), bf)
  mem = jnp.zeros((b, h, d, d), jnp.float32)
  kdn = ops.KDNState(mem, jnp.ones((b, h, d), jnp.float32))
  iso = ops.KDNState(mem, jnp.ones((b, h), jnp.float32))
  cases = [
    (lambda *a: ops.diag_kdn_step(*a, kdn, impl="pallas"), (*x, lane, head), "decode_step_diag"),
    (lambda *a: ops.iso_kdn_step(*a, iso, impl="pallas"), (*x, head, head), "decode_step_iso"),
    (lambda *a: ops.kda_step(*a, mem, impl="pallas"), (*x, head), "decode_step_beta"),
    (
      lambda *a: ops.delta_rule_step(*a, mem, impl="pallas"),
      (*x[:3], head, lane),
      "decode_step_write",
    ),
  ]
  for fn, args, name in cases:
    text = _lower_for_cuda(fn, *args)
    assert "@__gpu$xla.gpu.triton" in text and name in text, name


def test_chunk_states_backward_lowers_for_cuda(as_on_gpu):
  """The delta rule with output_chunk_states, differentiated: the reverse chain's state-cotangent
  input (dext) lowers."""
  from pallas_kernels import delta_rule  # pylint: disable=g-import-not-at-top

  b, t, h, d = 1, 64, 2, 64
  q, k, v, la, w = (jnp.ones((b, t, h, d), jnp.bfloat16) for _ in range(5))
  seg = (jnp.arange(t)[None, :] >= 37).astype(jnp.int32)

  def loss(q, k, v, la, w, h0):
    o, sfin, states, _ = delta_rule(
      q, k, v, la, w, 0.1, h0, seg, chunk_size=16, output_chunk_states=True
    )
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(states) + jnp.sum(sfin)

  text = _lower_for_cuda(
    jax.grad(loss, argnums=tuple(range(6))), q, k, v, la, w, jnp.zeros((b, h, d, d), jnp.float32)
  )
  assert "delta_rule_recur_bwd" in text
