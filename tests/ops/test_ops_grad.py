"""Gradients of every op and impl, the initial state included, against
autodiff of the float64 token loop; plus numerical checks on tiny shapes."""

import jax
import jax.numpy as jnp
import kdn_oracle
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads
from ops_cases import FAMILIES, make_inputs, make_state, rel_err, round_f32

from kdn_jax import ops

B, T, H, K, V = 2, 45, 2, 16, 32  # widths the Pallas kernels take


def _arg_names(family):
  base = ["q", "k", "v", "log_alpha"]
  if family in ("diag", "iso"):
    return base + ["omega", "r", "memory", "variance", "info_scale"]
  return base + ["write", "memory"]


def _mu(h, kd):
  """A per-head info_scale (mu), differentiated like a learned one."""
  return np.linspace(0.5, 2.0, h) * kd


def _outputs_fn(family, impl, segment_ids, kernel_config=None):
  """(o, final state tuple) of (inputs..., state..., info_scale)."""

  def outputs(*args):
    kw = dict(impl=impl, output_final_state=True, segment_ids=segment_ids, chunk_size=16)
    kw.update(kernel_config=kernel_config)
    if family in ("diag", "iso"):
      q, k, v, la, om, r, mem, var, mu = args
      fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
      o, st = fn(q, k, v, la, om, r, info_scale=mu, initial_state=ops.KDNState(mem, var), **kw)
      return o, (st.memory, st.variance)
    q, k, v, la, w, mem = args
    o, s = ops.delta_rule(q, k, v, la, w, initial_state=mem, **kw)
    return o, (s,)

  return outputs


def _loss_fn(family, impl, segment_ids, kernel_config=None):
  """Scalar loss of (inputs..., state..., info_scale) touching outputs and
  final state."""
  outputs = _outputs_fn(family, impl, segment_ids, kernel_config)
  return lambda *args: _weighted(*outputs(*args))


def _weighted(o, final):
  # Fixed, position-dependent weights so every output element matters.
  total = jnp.sum(jnp.sin(jnp.arange(o.size).reshape(o.shape)) * o)
  for i, f in enumerate(final):
    total += jnp.sum(jnp.cos(jnp.arange(f.size).reshape(f.shape) + i) * f)
  return total


def _oracle_outputs(family, segment_ids, kd):
  """_outputs_fn's (o, final state tuple) from the float64 token loop."""
  scale = kd**-0.5

  def outputs(*args):
    if family in ("diag", "iso"):
      q, k, v, la, om, r, mem, var, mu = args
      o, s, p = kdn_oracle.kdn(
        q, k, v, la, om, r, mem, var, mu, scale, family == "diag", segment_ids
      )
      return o, (s, p)
    q, k, v, la, w, mem = args
    o, s = kdn_oracle.delta_rule(q, k, v, la, w, mem, scale, segment_ids)
    return o, (s,)

  return outputs


def _oracle_loss(family, segment_ids, kd):
  outputs = _oracle_outputs(family, segment_ids, kd)
  return lambda *args: _weighted(*outputs(*args))


def _arrays(family, x, state, h, kd):
  names = _arg_names(family)
  arrays = [x[n] for n in names if n in x] + list(state)
  if "info_scale" in names:
    arrays.append(_mu(h, kd))
  return names, arrays


# Pallas (interpret mode, several seconds per gradient on CPU) runs with
# packed segments, where every kernel path runs (resets, the initial state's
# share); without them only for one family of each kernel (gain, decay).
GRAD_CASES = (
  [(f, i, s) for f in FAMILIES for i in ("reference", "chunked") for s in (False, True)]
  + [(f, "pallas", True) for f in FAMILIES]
  + [("diag", "pallas", False), ("delta_scalar", "pallas", False)]
)


@pytest.mark.parametrize("family,impl,segmented", GRAD_CASES)
def test_grads_match_token_loop(family, impl, segmented):
  """Every gradient (inputs, initial state, info_scale) against autodiff of
  the float64 token loop."""
  x = round_f32(make_inputs(family, B, T, H, K, V, seed=11))
  state = round_f32(dict(enumerate(make_state(family, B, H, K, V))))
  names, arrays = _arrays(family, x, [state[i] for i in sorted(state)], H, K)
  seg = None
  if segmented:
    s = np.zeros((B, T), np.int32)
    s[0, 20:] = 1
    s[1, 9:30], s[1, 30:] = 1, 2
    seg = jnp.asarray(s)
  argnums = tuple(range(len(arrays)))
  got = jax.grad(_loss_fn(family, impl, seg), argnums)(
    *(jnp.asarray(a, jnp.float32) for a in arrays)
  )
  with jax.enable_x64(True):
    want = jax.grad(_oracle_loss(family, seg, K), argnums)(
      *(jnp.asarray(a, jnp.float64) for a in arrays)
    )
    want = [np.asarray(w) for w in want]
  assert len(got) == len(names)
  for name, g, w in zip(names, got, want):
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, w) <= 1e-4, (name, rel_err(g, w))


# Widths the Pallas kernels pad (ops/widths.py) and grouped value heads (ops/heads.py): q and k
# with 1 head for 2 value heads, so their gradients sum over the group. Pallas: the iso gain's
# padding, whose mean over K moves into log_alpha and mu (the others' are plain zeros, whose
# gradients are slices), with K and V padded.
GROUPED_GRAD_CASES = [("delta_channel", "chunked", 8, 40), ("iso", "pallas", 48, 8)]


@pytest.mark.parametrize("family,impl,kd,vd", GROUPED_GRAD_CASES)
def test_grads_at_any_width_with_grouped_heads(family, impl, kd, vd):
  b, t, h = 1, 20, 2
  x = round_f32(make_inputs(family, b, t, h, kd, vd, seed=17, hk=1))
  state = round_f32(dict(enumerate(make_state(family, b, h, kd, vd))))
  names, arrays = _arrays(family, x, [state[i] for i in sorted(state)], h, kd)
  seg = jnp.asarray([[0] * 7 + [1] * (t - 7)])
  argnums = tuple(range(len(arrays)))
  got = jax.grad(_loss_fn(family, impl, seg), argnums)(
    *(jnp.asarray(a, jnp.float32) for a in arrays)
  )
  oracle_loss = _oracle_loss(family, seg, kd)

  def grouped_oracle_loss(q, k, *rest):  # q, k read by both value heads
    return oracle_loss(jnp.repeat(q, h, axis=2), jnp.repeat(k, h, axis=2), *rest)

  with jax.enable_x64(True):
    want = jax.grad(grouped_oracle_loss, argnums)(*(jnp.asarray(a, jnp.float64) for a in arrays))
  assert got[0].shape == x["q"].shape and got[1].shape == x["k"].shape
  for name, g, w in zip(names, got, want):
    assert np.all(np.isfinite(g)), name
    assert rel_err(g, np.asarray(w)) <= 1e-4, (name, rel_err(g, np.asarray(w)))


# Head widths above 128 on the Pallas kernels (key tiles in the intra-chunk kernels, narrower V
# blocks in the [K, V] ones: DeltaRuleConfig.block_k, wide_block_v*): each op at K = 256 and each
# of K = V = 256, K = 256 with V = 64, K = 64 with V = 256; T ragged (chunk 16) with a reset
# inside a chunk; one case under x64. B = H = 1: interpret mode at K = 256 is the slow part.
WIDE_CASES = [
  ("diag", 256, 256, False),
  ("iso", 256, 64, False),
  ("delta_channel", 64, 256, False),
  ("delta_scalar", 256, 256, True),
]


@pytest.mark.parametrize("family,kd,vd,x64", WIDE_CASES)
def test_wide_heads_match_token_loop(family, kd, vd, x64):
  """Outputs, final states and every gradient at widths above 128 on impl='pallas' against the
  float64 token loop."""
  b, t, h = 1, 37, 1
  x = round_f32(make_inputs(family, b, t, h, kd, vd, seed=kd + vd))
  state = round_f32(dict(enumerate(make_state(family, b, h, kd, vd))))
  names, arrays = _arrays(family, x, [state[i] for i in sorted(state)], h, kd)
  seg = jnp.asarray([[0] * 9 + [1] * (t - 9)])

  def values_and_grads(fn, dtype):
    outs, vjp = jax.vjp(jax.jit(fn), *(jnp.asarray(a, dtype) for a in arrays))
    o, final = outs
    # the cotangents _weighted's loss gives: every output and final-state element matters
    cts = jax.grad(_weighted, (0, 1))(o.astype(dtype), tuple(f.astype(dtype) for f in final))
    return (o, *final), vjp(cts)

  with jax.enable_x64(x64):
    got, got_grads = values_and_grads(_outputs_fn(family, "pallas", seg), jnp.float32)
  with jax.enable_x64(True):
    want, want_grads = values_and_grads(_oracle_outputs(family, seg, kd), jnp.float64)
  for name, g, w in zip(("output", "memory", "variance"), got, want):
    assert rel_err(g, np.asarray(w)) <= 1e-5, (name, rel_err(g, np.asarray(w)))
  for name, g, w in zip(names, got_grads, want_grads):
    assert g.shape == w.shape and np.all(np.isfinite(g)), name
    assert rel_err(g, np.asarray(w)) <= 1e-4, (name, rel_err(g, np.asarray(w)))


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_check_grads_numerically(family, impl):
  """Central finite differences in float64 (info_scale included): the
  gradients the float64 oracle is autodiffed to are themselves right.
  Not Pallas: its kernels compute in float32 and take K >= 16."""
  b, t, h, kd, vd = 1, 5, 2, 4, 3
  with jax.enable_x64(True):
    x = make_inputs(family, b, t, h, kd, vd, seed=12)
    _, arrays = _arrays(family, x, make_state(family, b, h, kd, vd), h, kd)
    seg = jnp.asarray([[0, 0, 1, 1, 1]])
    check_grads(
      _loss_fn(family, impl, seg),
      [jnp.asarray(a) for a in arrays],
      order=1,
      modes=["rev"],
      eps=1e-6,
      atol=1e-6,
      rtol=1e-6,
    )


def test_bf16_kappa_within_bf16_bounds():
  """The diag gain stores kappa in bf16 for bf16 data (pallas_kernels.write_dtype): the diag KDN
  op on bf16 q, k, v with packed segments, values and every gradient against the float64 loop,
  within bf16 bounds."""
  x = round_f32(make_inputs("diag", B, T, H, K, V, seed=12))
  for n in ("q", "k", "v"):  # the oracle sees the bf16-rounded data
    x[n] = np.asarray(jnp.asarray(x[n], jnp.bfloat16).astype(jnp.float32), np.float64)
  state = make_state("diag", B, H, K, V)
  names, arrays = _arrays("diag", x, [round_f32({0: s})[0] for s in state], H, K)
  s = np.zeros((B, T), np.int32)
  s[0, 20:] = 1
  seg = jnp.asarray(s)
  argnums = tuple(range(len(arrays)))
  with jax.enable_x64(True):
    want_l, want = jax.value_and_grad(_oracle_loss("diag", seg, K), argnums)(
      *(jnp.asarray(a, jnp.float64) for a in arrays)
    )
    want = [np.asarray(w) for w in want]
  args = [
    jnp.asarray(a, jnp.bfloat16 if n in ("q", "k", "v") else jnp.float32)
    for n, a in zip(names, arrays)
  ]
  loss, got = jax.value_and_grad(_loss_fn("diag", "pallas", seg, None), argnums)(*args)
  errs = {n: rel_err(np.asarray(g, np.float32), w) for n, g, w in zip(names, got, want)}
  errs["loss"] = abs(float(loss) - float(want_l)) / abs(float(want_l))
  for n, e in errs.items():
    assert e <= 1e-2, (n, errs)


def test_diag_gain_grads_under_shard_map_with_replicated_info_scale():
  """Inside shard_map the chunked diag gain's custom backward gets a replicated (unvarying)
  info_scale and initial variance beside batch-sharded inputs: their gradients are the sums over
  shards, as autodiff of the plain op gives."""
  x = make_inputs("diag", B, 16, H, K, K, seed=5)
  arrays = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "log_alpha", "omega", "r")]
  mu, p0 = jnp.asarray(_mu(H, K), jnp.float32), jnp.full((H, K), 0.7, jnp.float32)

  def loss(mu, p0, *a):
    var = ops.KDNState(
      jnp.zeros((a[0].shape[0], H, K, K)), jnp.broadcast_to(p0, (a[0].shape[0], H, K))
    )
    o, st = ops.diag_kdn(
      *a, info_scale=mu, initial_state=var, output_final_state=True, impl="chunked", chunk_size=16
    )
    return jnp.sum(o**2) + jnp.sum(st.variance)

  grad = jax.grad(loss, argnums=(0, 1))
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  sharded = jax.shard_map(
    grad,
    mesh=mesh,
    in_specs=(P(), P()) + (P("data"),) * 6,
    out_specs=(P(), P()),
  )
  for got, want in zip(jax.jit(sharded)(mu, p0, *arrays), grad(mu, p0, *arrays)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
