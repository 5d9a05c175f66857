"""output_states_at: the state after chosen positions equals the final state of the prefix run on
its own (the float64 token loop, whose state after token p - 1 is its final state on x[:, :p],
and the same impl on the prefix), for every impl, with packed segments; gradients against the
float64 loop; bad positions give one clear error."""

import jax
import jax.numpy as jnp
import kdn_oracle
import numpy as np
import pytest
from ops_cases import make_inputs, make_state, rel_err, round_f32

from kdn_jax import ops

B, T, H, K, V = 2, 40, 2, 16, 32
# Chunk 16: a window's first token resets (row 1 at 16), a reset inside a window before p (row 0
# at 35, p = 38), p just before and just after a reset (10, 11), chunk ends (16, 32), T.
POSITIONS = np.array([1, 10, 11, 16, 20, 32, 33, 38, 40])


def _segments():
  s = np.zeros((B, T), np.int32)
  s[0, 10:], s[0, 35:] = 1, 2
  s[1, 16:] = 1
  return jnp.asarray(s)


def _kdn(family):
  return family in ("diag", "iso")


def _names(family):
  return ["q", "k", "v", "log_alpha"] + (["omega", "r"] if _kdn(family) else ["write"])


def _call(family, arrays, mu, impl, seg, positions):
  """The op on (inputs..., initial state...) -> (o, final, states at positions as a tuple)."""
  n = len(_names(family))
  c, st = arrays[:n], arrays[n:]
  kw = dict(
    impl=impl, output_final_state=True, chunk_size=16, output_states_at=positions, segment_ids=seg
  )
  if _kdn(family):
    fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
    out = fn(*c, info_scale=mu, initial_state=ops.KDNState(*st), **kw)
  else:
    out = ops.delta_rule(*c, initial_state=st[0], **kw)
  if positions is None:
    return tuple(out)
  return out[0], out[1], tuple(out[2]) if _kdn(family) else (out[2],)


def _oracle_every(family, arrays, mu, seg):
  """The float64 loop: (o, the state after every token as a tuple of [B, T, ...])."""
  n = len(_names(family))
  c, st = arrays[:n], arrays[n:]
  if _kdn(family):
    o, s, p = kdn_oracle.kdn(*c, st[0], st[1], mu, K**-0.5, family == "diag", seg, every=True)
    return o, (s, p)
  o, s = kdn_oracle.delta_rule(*c, st[0], K**-0.5, seg, every=True)
  return o, (s,)


def _case(family, seed=3):
  x = round_f32(make_inputs(family, B, T, H, K, V, seed=seed))
  state = [np.asarray(s, np.float32).astype(np.float64) for s in make_state(family, B, H, K, V)]
  return [x[n] for n in _names(family)] + state, x.get("mu")


def _f32(arrays):
  return [jnp.asarray(a, jnp.float32) for a in arrays]


CASES = [
  ("diag", "reference"),
  ("delta_channel", "reference"),
  ("diag", "chunked"),
  ("iso", "chunked"),
  ("delta_scalar", "chunked"),
]


@pytest.mark.parametrize("family,impl", CASES)
def test_states_at_equal_token_loop(family, impl):
  """Each state after p (memory and variance) against the float64 loop's state after token
  p - 1, with packed segments; o and the final state are those of the call without positions."""
  arrays, mu = _case(family)
  seg = _segments()
  o, final, at = _call(family, _f32(arrays), mu, impl, seg, POSITIONS)
  o_plain, final_plain = _call(family, _f32(arrays), mu, impl, seg, None)
  np.testing.assert_array_equal(o, o_plain)
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(final_plain)):
    np.testing.assert_array_equal(a, b)
  with jax.enable_x64(True):
    _, every = _oracle_every(family, [jnp.asarray(a) for a in arrays], mu, seg)
  assert len(at) == len(every)
  for got, want in zip(at, every):
    assert got.shape == (B, len(POSITIONS)) + want.shape[2:]
    for i, p in enumerate(POSITIONS):
      assert rel_err(got[:, i], want[:, p - 1]) < 2e-6, (p, rel_err(got[:, i], want[:, p - 1]))


def test_states_at_equal_the_op_on_the_prefix():
  """The same op run on the prefix alone ends in the same state (chunked, segments; positions
  inside a chunk, at a chunk end, and just after a reset)."""
  arrays, mu = _case("delta_channel", seed=4)
  seg = _segments()
  positions = np.array([11, 20, 32])
  _, _, (at,) = _call("delta_channel", _f32(arrays), mu, "chunked", seg, positions)
  for i, p in enumerate(positions):
    prefix = [a[:, :p] for a in arrays[:5]] + arrays[5:]
    _, final = _call("delta_channel", _f32(prefix), mu, "chunked", seg[:, :p], None)
    assert rel_err(at[:, i], final) < 1e-6, (p, rel_err(at[:, i], final))


def _weighted(o, states):
  total = jnp.sum(jnp.sin(o))
  for i, s in enumerate(states):
    total += jnp.sum(jnp.cos(jnp.arange(s.size, dtype=s.dtype).reshape(s.shape) + i) * s)
  return total


@pytest.mark.parametrize(
  "family,impl", [("iso", "chunked"), ("diag", "pallas"), ("delta_scalar", "pallas")]
)
def test_states_at_values_and_grads_match_token_loop(family, impl):
  """The states at positions and the gradients of a loss on o and those states (every input and
  the initial state) against the float64 loop, with packed segments. One vjp per case: the
  Pallas forward with chunk states and its backward (whose reverse chain takes their
  cotangents) compile once."""
  arrays, mu = _case(family, seed=5)
  seg = _segments()
  positions = np.array([11, 20, 32, 38])

  def loss(*args):
    o, _, at = _call(family, args, mu, impl, seg, positions)
    return _weighted(o, at), at

  def oracle_loss(*args):
    o, every = _oracle_every(family, args, mu, seg)
    at = tuple(s[:, positions - 1] for s in every)
    return _weighted(o, at), at

  argnums = tuple(range(len(arrays)))
  (_, at), got = jax.value_and_grad(loss, argnums, has_aux=True)(*_f32(arrays))
  with jax.enable_x64(True):
    (_, want_at), want = jax.value_and_grad(oracle_loss, argnums, has_aux=True)(
      *(jnp.asarray(a) for a in arrays)
    )
    want, want_at = [np.asarray(w) for w in want], [np.asarray(w) for w in want_at]
  for g, w in zip(at, want_at):
    assert rel_err(g, w) < 2e-6, rel_err(g, w)
  for name, g, w in zip(_names(family) + ["memory", "variance"], got, want):
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, w) <= 1e-4, (name, rel_err(g, w))


@pytest.mark.parametrize(
  "positions,error,match",
  [
    ([0, 3], ValueError, r"output_states_at must lie in \[1, T\] = \[1, 40\].*\[0\]"),
    ([3, 41], ValueError, r"output_states_at must lie in \[1, T\].*\[41\]"),
    ([5, 3], ValueError, "output_states_at must be sorted in ascending order"),
    ([1.0, 2.0], TypeError, "output_states_at must hold integers, got dtype float64"),
    ([[1, 2]], ValueError, r"output_states_at must be a non-empty 1-D array .* shape \(1, 2\)"),
    ([], ValueError, "output_states_at must be a non-empty 1-D array"),
  ],
)
@pytest.mark.parametrize("family,op", [("diag", "diag_kdn"), ("delta_channel", "delta_rule")])
def test_bad_positions_name_the_argument(family, op, positions, error, match):
  arrays, mu = _case(family)
  with pytest.raises(error, match=f"{op}: {match}"):
    _call(family, _f32(arrays), mu, "chunked", None, positions)


def test_traced_positions_are_refused():
  arrays, mu = _case("delta_channel")

  @jax.jit
  def f(p):
    return _call("delta_channel", _f32(arrays), mu, "chunked", None, p)

  with pytest.raises(TypeError, match="delta_rule: output_states_at must be concrete"):
    f(jnp.asarray([3, 5]))
