"""Context parallelism (kdn_jax.ops.context_parallel) against the single-device op.

The single-device ops are held to the float64 oracle elsewhere; here the
sequence is split over 2, 4 or 8 CPU devices and outputs, final states and
every gradient (inputs, initial state, a learned info_scale) must match the
unsplit op in fp32. T = 48 gives 24 / 12 / 6 tokens per slice, none a
multiple of the chunk (8 chunked, 16 Pallas), and the packed segments of row
0 cross slice boundaries (one slice start also starts a segment); row 1 is
one segment.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ops_cases import make_inputs, make_state, rel_err
from kdn_jax import ops
from kdn_jax.ops import context_parallel as cp

B, T, H, K, V = 2, 40, 2, 16, 8
TOL = 2e-5  # fp32: observed ~3e-7

# Row 0: segments of 5, 15, 12 (its second start sits at token 20 = a slice
# start for 2, 4 and 8 slices), 1 and 7 tokens; row 1: one segment.
SEGMENT_IDS = np.array([[0] * 5 + [1] * 15 + [2] * 12 + [3] + [4] * 7,
                        [0] * T], np.int32)

# (op, family of ops_cases.make_inputs, impl, segments, slice counts): the
# unsplit op is compiled once per row, the split one once per slice count.
CASES = [
    ("diag_kdn", "diag", "chunked", True, (8,)),
    ("iso_kdn", "iso", "chunked", True, (4,)),
    ("kda", "delta_channel", "chunked", False, (4,)),
    ("gated_delta_rule", "delta_scalar", "chunked", True, (2,)),
    ("diag_kdn", "diag", "pallas", True, (4,)),
]


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("context",))


def _case(op, family, seed=3):
  """(positional arrays, keyword arrays to differentiate, plain op)."""
  x = make_inputs(family, B, T, H, K, V, seed=seed)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  state = tuple(map(f32, make_state(family, B, H, K, V)))
  if family in ("diag", "iso"):
    arrays = [f32(x[n]) for n in ("q", "k", "v", "log_alpha", "omega", "r")]
    # A learned (traced) info_scale per head, so its gradient is checked too.
    diff_kw = dict(initial_state=ops.KDNState(*state),
                   info_scale=jnp.full((H,), float(K)) * jnp.array([1.0, 0.5]))
  else:
    # kda / gated_delta_rule: write = beta * k with beta [B, T, H].
    beta = f32(np.random.default_rng(seed).uniform(0.1, 0.9, (B, T, H)))
    arrays = [f32(x[n]) for n in ("q", "k", "v", "log_alpha")] + [beta]
    diff_kw = dict(initial_state=state[0])
  return arrays, diff_kw, getattr(ops, op)


def _loss_and_grads(fn, arrays, diff_kw, static_kw, seed=7):
  """Compiled value_and_grad of a fixed random projection of (o, final
  state): ((loss, (o, final)), grads) and the compiled HLO text."""

  def loss(arrays, diff_kw):
    o, final = fn(*arrays, output_final_state=True, **diff_kw, **static_kw)
    rng = np.random.default_rng(seed)
    total = jnp.sum(o * rng.standard_normal(o.shape))
    for s in jax.tree.leaves(final):
      total = total + jnp.sum(s * rng.standard_normal(s.shape))
    return total, (o, final)

  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
                     ).lower(arrays, diff_kw).compile()
  return compiled(arrays, diff_kw), compiled.as_text()


def _assert_close(got, want, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape, what
    err = rel_err(g, w)
    assert err < TOL, f"{what}: relative error {err:.2e}"


def _all_gather_shapes(hlo):
  shapes = []
  for line in hlo.splitlines():
    if re.search(r"\ball-gather(-start)?\(", line):
      lhs = line.split("all-gather")[0]
      shapes += [tuple(int(d) for d in dims.split(",") if d)
                 for dims in re.findall(r"\[([\d,]*)\]", lhs)]
  return shapes


def _assert_no_sequence_gather(hlo, n):
  """Only per-slice maps (and the slices' last segment ids) are all-gathered
  in fwd+bwd, never anything with a time axis."""
  shapes = _all_gather_shapes(hlo)
  assert shapes, "expected the per-slice maps to be all-gathered"
  for shape in shapes:
    assert T not in shape and T // n not in shape[1:], shape
    assert np.prod(shape) <= n * B * H * K * K, shape


@pytest.mark.parametrize("op,family,impl,segments,slices", CASES)
def test_equals_single_device(op, family, impl, segments, slices):
  arrays, diff_kw, plain = _case(op, family)
  seg = jnp.asarray(SEGMENT_IDS) if segments else None
  static_kw = dict(impl=impl, chunk_size=8 if impl == "chunked" else 16,
                   segment_ids=seg)
  ((_, (o0, s0)), g0), _ = _loss_and_grads(plain, arrays, diff_kw, static_kw)
  for n in slices:
    mesh = _mesh(n)
    # Inputs arrive split along T, as under a context-parallel jit.
    put = lambda a, mesh=mesh: jax.device_put(
        a, NamedSharding(mesh, P(None, "context")))
    sharded_kw = dict(static_kw, segment_ids=None if seg is None else put(seg))
    ((_, (o1, s1)), g1), hlo = _loss_and_grads(
        cp.context_sharded(op, mesh), [put(a) for a in arrays], diff_kw,
        sharded_kw)
    _assert_close(o1, o0, f"outputs, {n} slices")
    _assert_close(s1, s0, f"final state, {n} slices")
    _assert_close(g1, g0, f"gradients, {n} slices")
    _assert_no_sequence_gather(hlo, n)


def test_inside_user_shard_map():
  """The op-level entry inside a user's shard_map (batch and context axes)."""
  arrays, diff_kw, _ = _case("diag_kdn", "diag")
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
  seq, per_seq = P("data", "context"), P("data")

  def body(arrays, init, seg):
    return cp.diag_kdn(*arrays, axis_name="context", initial_state=init,
                       segment_ids=seg, output_final_state=True,
                       impl="chunked", chunk_size=16)

  f = jax.jit(jax.shard_map(body, mesh=mesh,
                            in_specs=((seq,) * 6, per_seq, seq),
                            out_specs=(seq, per_seq)))
  seg = jnp.asarray(SEGMENT_IDS)
  o1, s1 = f(tuple(arrays), diff_kw["initial_state"], seg)
  o0, s0 = ops.diag_kdn(*arrays, initial_state=diff_kw["initial_state"],
                        segment_ids=seg, output_final_state=True,
                        impl="chunked", chunk_size=16)
  _assert_close((o1, s1), (o0, s0), "outputs and final state")


def test_errors_name_the_argument():
  mesh = _mesh(4)
  arrays, _, _ = _case("diag_kdn", "diag")
  short = [a[:, :38] for a in arrays]  # 38 is not a multiple of 4
  with pytest.raises(ValueError, match=r"T=38 .*'context' of size 4"):
    cp.context_sharded("diag_kdn", mesh)(*short, impl="chunked")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    cp.context_sharded("diag_kdn", mesh, axis_name="seq")(*arrays)
  with pytest.raises(ValueError, match="impl='reference'"):
    cp.context_sharded("diag_kdn", mesh)(*arrays, impl="reference")
  with pytest.raises(ValueError, match="op='mamba' is not one of"):
    cp.context_sharded("mamba", mesh)
  with pytest.raises(ValueError, match="axis_name='context' is not a mesh axis"):
    cp.diag_kdn(*arrays, axis_name="context")
