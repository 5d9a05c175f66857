"""The Pallas path under a sharded jit runs per (batch, head) shard (pallas_kernels.sharding):
same numbers as one device, no operand gathered, and it still composes with vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from ops_cases import make_inputs

from kdn_jax import ops

B, T, H, K, V = 4, 40, 4, 16, 16
NAMES = ("q", "k", "v", "log_alpha", "omega", "r")


def _args(family):
  x = make_inputs(family, B, T, H, K, V, seed=3)
  args = [jnp.asarray(x[n], jnp.float32) for n in NAMES]
  mu = jnp.linspace(8.0, 24.0, H)  # per-head info_scale: its gradient sums over batch shards
  seg = jnp.asarray((np.arange(T)[None, :] >= np.array([[7], [19], [40], [33]])).astype(np.int32))
  return args, mu, seg


def _loss(family):
  fn = ops.diag_kdn if family == "diag" else ops.iso_kdn

  def loss(q, k, v, la, om, r, mu, seg):
    o, st = fn(
      q, k, v, la, om, r, info_scale=mu, segment_ids=seg, impl="pallas", output_final_state=True
    )
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(st.memory) + jnp.sum(st.variance)

  return loss


# (mesh shape, mesh axes, batch axes): data parallel with heads over "tensor", and FSDP-style
# batch over two mesh axes at once (experiments/runner/sharding.py's BATCH_AXES).
MESHES = {
  "data_tensor": ((2, 2), ("data", "tensor"), "data"),
  "data_fsdp_tensor": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp")),
}


def _mesh(shape, names):
  n = int(np.prod(shape))
  devices = np.array(jax.devices()[:n])
  if len(devices) < n:
    pytest.fail(f"tests need >= {n} devices (conftest sets 8 CPU devices)")
  return Mesh(devices.reshape(shape), names)


@pytest.fixture
def partitioner(request):
  """Both XLA partitioners: Shardy (jax's default) uses per_shard's sharding rule, GSPMD its
  callbacks."""
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", before)


# Each family, mesh and partitioner once (diag on data_tensor under shardy repeats the rest).
@pytest.mark.parametrize(
  "family,mesh_name,partitioner",
  [
    ("iso", "data_tensor", "shardy"),
    ("diag", "data_fsdp_tensor", "shardy"),
    ("diag", "data_tensor", "gspmd"),
  ],
  indirect=["partitioner"],
)
def test_sharded_jit_runs_per_shard(family, mesh_name, partitioner):
  del partitioner
  shape, names, batch = MESHES[mesh_name]
  mesh = _mesh(shape, names)
  args, mu, seg = _args(family)
  bth = lambda a: jax.device_put(a, NamedSharding(mesh, P(batch, None, "tensor")))
  sharded = [bth(a) for a in args] + [
    jax.device_put(mu, NamedSharding(mesh, P("tensor"))),
    jax.device_put(seg, NamedSharding(mesh, P(batch))),
  ]
  loss = _loss(family)
  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
  want_val, want = grad(*args, mu, seg)
  got_val, got = grad(*sharded)
  # (the scalar loss sums the shards' partial sums in another order: fp32 rounding, seen at 1.1e-6)
  np.testing.assert_allclose(got_val, want_val, rtol=1e-5)
  for name, g, w in zip(NAMES + ("info_scale",), got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)
  # The kernels ran on the shards: no operand was gathered, and the output keeps the sharding.
  hlo = grad.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo
  # Forward only and without segments (no cont / pid operands, no saved residuals).
  fn = ops.diag_kdn if family == "diag" else ops.iso_kdn
  fwd = jax.jit(lambda *a: fn(*a[:6], info_scale=a[6], impl="pallas")[0])
  out = fwd(*sharded[:7])
  assert out.sharding.spec == P(batch, None, "tensor")
  np.testing.assert_allclose(out, fwd(*args, mu), rtol=2e-5, atol=2e-6)


def test_time_sharded_operand_is_gathered_with_a_warning(caplog):
  mesh = _mesh((2, 2), ("data", "tensor"))
  args, _, _ = _args("diag")
  # q sharded along T as well: the kernels cannot keep that, so it is gathered (still correct).
  q = jax.device_put(args[0], NamedSharding(mesh, P("data", "tensor")))
  f = jax.jit(lambda *a: ops.diag_kdn(*a, impl="pallas")[0])
  with caplog.at_level("WARNING"):
    got = f(q, *args[1:])
  np.testing.assert_allclose(got, f(*args), rtol=2e-5, atol=2e-6)
  assert any("gathered" in r.getMessage() for r in caplog.records)


def test_inside_shard_map_without_vma_check():
  mesh = _mesh((2,), ("x",))
  args, _, _ = _args("diag")
  body = lambda *a: ops.diag_kdn(*a, impl="pallas")[0]
  sm = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False)
  )
  np.testing.assert_allclose(sm(*args), jax.jit(body)(*args), rtol=2e-5, atol=2e-6)


def test_pallas_path_vmaps():
  args, _, _ = _args("diag")
  f = lambda q: ops.diag_kdn(q, *args[1:], impl="pallas")[0]
  qs = jnp.stack([args[0], 2 * args[0]])
  got = jax.jit(jax.vmap(f))(qs)
  np.testing.assert_allclose(got[1], f(2 * args[0]), rtol=1e-5, atol=1e-6)
