"""Context parallelism (kdn_jax.ops.context_parallel) against the single-device op.

The single-device ops are held to the float64 oracle elsewhere; here the
sequence is split over 2, 4 or 8 CPU devices and outputs, final states and
every gradient (inputs, initial state, a learned info_scale) must match the
unsplit op in fp32. T = 40 gives 20 / 10 / 5 tokens per slice, none a
multiple of the chunk (8 chunked, 16 Pallas), and the packed segments of row
0 cross slice boundaries (one slice start also starts a segment); row 1 is
one segment.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from ops_cases import make_inputs, make_state, rel_err

from kdn_jax import ops
from kdn_jax.ops import context_parallel as cp
from kdn_jax.ops import context_sharding as cs

B, T, H, K, V = 2, 40, 2, 16, 8
TOL = 2e-5  # fp32: observed ~3e-7

# Row 0: segments of 5, 15, 12 (its second start sits at token 20 = a slice
# start for 2, 4 and 8 slices), 1 and 7 tokens; row 1: one segment.
SEGMENT_IDS = np.array([[0] * 5 + [1] * 15 + [2] * 12 + [3] + [4] * 7, [0] * T], np.int32)

# (op, family of ops_cases.make_inputs, impl, segments, slices, batch split):
# the batch split puts B over a 'data' axis too (batch_axes). Pallas runs
# with V = 32: the augmented memory's V + K = 48 columns run padded to the
# kernel width 64 (ops/widths.py).
CASES = [
  ("diag_kdn", "diag", "chunked", True, 8, 1),
  ("iso_kdn", "iso", "chunked", True, 4, 1),
  ("kda", "delta_channel", "chunked", False, 4, 2),
  ("gated_delta_rule", "delta_scalar", "chunked", True, 2, 1),
  ("diag_kdn", "diag", "pallas", True, 4, 1),
  # the write as beta [B, T, H] (formed in the kernels): iso KDN's gain
  ("iso_kdn", "iso", "pallas", True, 2, 1),
]


def _mesh(n, data=1):
  return Mesh(np.array(jax.devices()[: n * data]).reshape(data, n), ("data", "context"))


def _case(op, family, seed=3, vd=V):
  """(positional arrays, keyword arrays to differentiate, plain op)."""
  x = make_inputs(family, B, T, H, K, vd, seed=seed)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  state = tuple(map(f32, make_state(family, B, H, K, vd)))
  if family in ("diag", "iso"):
    arrays = [f32(x[n]) for n in ("q", "k", "v", "log_alpha", "omega", "r")]
    # A learned (traced) info_scale per head, so its gradient is checked too.
    diff_kw = dict(
      initial_state=ops.KDNState(*state),
      info_scale=jnp.full((H,), float(K)) * jnp.array([1.0, 0.5]),
    )
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

  compiled = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(arrays, diff_kw).compile()
  )
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
      shapes += [
        tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", lhs)
      ]
  return shapes


def _assert_no_sequence_gather(hlo, n, vd):
  """Only per-slice maps (and the slices' last segment ids) are all-gathered
  in fwd+bwd, never anything with a time axis."""
  shapes = _all_gather_shapes(hlo)
  assert shapes, "expected the per-slice maps to be all-gathered"
  for shape in shapes:
    assert T not in shape and T // n not in shape[1:], shape
    assert np.prod(shape) <= n * B * H * K * max(K, vd), shape


@pytest.mark.parametrize("op,family,impl,segments,n,data", CASES)
def test_equals_single_device(op, family, impl, segments, n, data, caplog):
  vd = 32 if impl == "pallas" else V
  arrays, diff_kw, plain = _case(op, family, vd=vd)
  seg = jnp.asarray(SEGMENT_IDS) if segments else None
  static_kw = dict(impl=impl, chunk_size=8 if impl == "chunked" else 16, segment_ids=seg)
  ((_, (o0, s0)), g0), _ = _loss_and_grads(plain, arrays, diff_kw, static_kw)
  mesh = _mesh(n, data)
  batch_axes = "data" if data > 1 else None
  # Inputs arrive split along T, as under a context-parallel jit.
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(batch_axes, "context")))
  sharded_kw = dict(static_kw, segment_ids=None if seg is None else put(seg))
  sharded = cs.context_sharded(op, mesh, batch_axes=batch_axes)
  ((_, (o1, s1)), g1), hlo = _loss_and_grads(sharded, [put(a) for a in arrays], diff_kw, sharded_kw)
  _assert_close(o1, o0, "outputs")
  _assert_close(s1, s0, "final state")
  _assert_close(g1, g0, "gradients")
  _assert_no_sequence_gather(hlo, n, vd)
  assert not any("unavailable" in r.getMessage() for r in caplog.records), (
    "the Pallas path fell back to chunked"
  )
  if impl == "pallas":
    # bf16 data: 'fast' kernel dots, o_K back in bf16. Outputs within the bound of test_ops_api's
    # bf16 test (input rounding) against the fp32 op; every gradient no further from the fp32 one
    # than twice the plain bf16 op's own error (or 2e-2): the split adds no error of its own.
    arrays16 = [a.astype(jnp.bfloat16) for a in arrays]
    ((_, (o16, _)), g16), _ = _loss_and_grads(
      sharded, [put(a) for a in arrays16], diff_kw, sharded_kw
    )
    (_, g16_plain), _ = _loss_and_grads(plain, arrays16, diff_kw, static_kw)
    assert o16.dtype == jnp.bfloat16
    assert rel_err(o16, o0) < 2e-2
    for got, base, want in zip(
      jax.tree.leaves(g16), jax.tree.leaves(g16_plain), jax.tree.leaves(g0)
    ):
      assert rel_err(got, want) <= max(2 * rel_err(base, want), 2e-2), (
        rel_err(got, want),
        rel_err(base, want),
      )


def test_errors_name_the_argument():
  mesh = _mesh(4)
  arrays, _, _ = _case("diag_kdn", "diag")
  short = [a[:, :38] for a in arrays]  # 38 is not a multiple of 4
  with pytest.raises(ValueError, match=r"T=38 .*'context' of size 4"):
    cs.context_sharded("diag_kdn", mesh)(*short, impl="chunked")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    cs.context_sharded("diag_kdn", mesh, axis_name="seq")(*arrays)
  with pytest.raises(ValueError, match="impl='reference'"):
    cs.context_sharded("diag_kdn", mesh)(*arrays, impl="reference")
  with pytest.raises(ValueError, match="op='mamba' is not one of"):
    cs.context_sharded("mamba", mesh)
  with pytest.raises(ValueError, match="axis_name='context' is not a mesh axis"):
    cp.diag_kdn(*arrays, axis_name="context")


def test_training_step_context_2_equals_context_1(tmp_path, monkeypatch):
  """One trainer step of a KDN + KDA model: mesh.context=2 (T split, the
  layers calling the context-parallel ops) against one device."""
  from runner_helpers import host, tiny_config  # pylint: disable=g-import-not-at-top

  from experiments.runner import (
    sharding,  # pylint: disable=g-import-not-at-top
    trainer,  # pylint: disable=g-import-not-at-top
  )

  def one_step(context, workdir):
    c = tiny_config(layer_pattern="kdn_diag,kda")
    c.model.impl = "chunked"
    c.data.seq_len = 24  # 12 per slice: no HLO dim below is mistaken for it
    c.mesh.data, c.mesh.fsdp, c.mesh.context = 1, 1, context
    tr = trainer.Trainer(c, str(workdir), devices=jax.devices()[:context])
    batch = next(tr.data_iter)
    metrics = tr.train_step(batch)
    out = float(metrics["loss"]), host(tr.state["params"])
    if context > 1:
      # The whole step moves no sequence between devices: no all-to-all
      # (the short convs exchange halos), all-gathers of per-slice maps only.
      with sharding.context_parallel(tr.mesh):
        hlo = (
          tr._train_step_jit.jitted.lower(  # pylint: disable=protected-access
            tr.state, tr.rest, sharding.global_batch(batch, tr.mesh)
          )
          .compile()
          .as_text()
        )
      assert not re.search(r"\ball-to-all(-start)?\(", hlo)
      t = c.data.seq_len
      for shape in _all_gather_shapes(hlo):
        assert t not in shape and t // context not in shape[1:], shape
    tr.close()
    return out

  built = []
  real = cs.context_sharded
  monkeypatch.setattr(
    cs, "context_sharded", lambda name, *a, **k: built.append(name) or real(name, *a, **k)
  )
  loss1, p1 = one_step(1, tmp_path / "one")
  assert not built
  loss2, p2 = one_step(2, tmp_path / "two")
  assert set(built) == {"diag_kdn", "kda"}, built
  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_benchmark_runs_in_tiny_mode(tmp_path, monkeypatch):
  """Every section, row, file; forward only here (the fwd+bwd of the ops is
  the equality tests' subject, and three more fwd+bwd compiles cost ~20 s)."""
  import json  # pylint: disable=g-import-not-at-top

  from experiments.benchmarks import context_parallel as bench  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(bench, "_fwd_bwd", lambda fn, impl: jax.jit(lambda *a: fn(*a, impl=impl)[0]))
  bench.FLAGS.unparse_flags()
  bench.FLAGS(["bench", "--tiny", f"--out={tmp_path}", "--contexts=2"])
  try:
    bench.main(None)
  finally:
    bench.FLAGS.unparse_flags()
  result = json.load(open(tmp_path / "benchmark_context_parallel.json"))
  rows = {(r["section"], r["context"]): r for r in result["rows"]}
  assert set(rows) == {("overhead+long", 0), ("overhead+long", 1), ("split", 2)}, rows
  for r in rows.values():
    assert "error" not in r and r["ms"] > 0, r
  assert (tmp_path / "benchmark_context_parallel.md").exists()


def test_evaluate_context_flag_routes_the_layers_ops():
  """experiments/evaluate.py --context=N: while the suites run, the layers'
  ops are the context-parallel ones over N devices (their numbers are the
  op tests' and the training test's)."""
  from experiments import evaluate  # pylint: disable=g-import-not-at-top

  assert cs.op("diag_kdn") is ops.diag_kdn
  with evaluate.context_parallel(1):
    assert cs.op("kda") is ops.kda
  built = []
  real = cs.context_sharded
  try:
    cs.context_sharded = lambda name, mesh, **k: (
      built.append((name, dict(mesh.shape))) or real(name, mesh, **k)
    )
    with evaluate.context_parallel(2):
      assert cs.op("diag_kdn") is not ops.diag_kdn
  finally:
    cs.context_sharded = real
  assert built == [("diag_kdn", {"data": 1, "fsdp": 1, "tensor": 1, "context": 2})], built
  with pytest.raises(ValueError, match=r"--context: must be in \[1, 8\]"):
    evaluate.context_parallel(9)


@pytest.mark.parametrize(
  "mutate,match",
  [
    (lambda c: setattr(c.mesh, "context", 2), r"config\.model\.impl: 'reference' has no"),
    (
      lambda c: (
        setattr(c.mesh, "context", 2),
        setattr(c.model, "impl", "chunked"),
        setattr(c.data, "eval_seq_len", 17),
      ),
      r"config\.data\.eval_seq_len: 17 is not divisible by mesh\.context = 2",
    ),
    (
      lambda c: (setattr(c.mesh, "context", 3), setattr(c.model, "impl", "chunked")),
      r"config\.mesh: fixed axes .*'context': 3.* do not divide the 8 devices",
    ),
  ],
)
def test_config_mesh_context_is_validated(mutate, match):
  from runner_helpers import tiny_config  # pylint: disable=g-import-not-at-top

  from experiments import schema  # pylint: disable=g-import-not-at-top

  c = tiny_config()
  mutate(c)
  with pytest.raises(schema.ConfigError, match=match):
    schema.check_mesh(schema.validate(c), 8)


@pytest.mark.parametrize("n", [4])
def test_short_conv_halo_equals_plain(n):
  """layers.context_conv.short_conv under sequence_sharding: outputs, the
  new cache and the gradients (input, cache, weight) equal ShortConv's, with
  packed segments (one starting at a slice start, whose halo it must not
  read, two within W-1 tokens after one) and a given cache."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from kdn_jax.layers.context_conv import short_conv  # pylint: disable=g-import-not-at-top
  from kdn_jax.layers.short_conv import ShortConv  # pylint: disable=g-import-not-at-top

  conv = ShortConv((H, K), 4, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
  cache = jnp.asarray(rng.standard_normal((B, 3, H, K)), jnp.float32)
  seg = jnp.asarray(SEGMENT_IDS)
  ct = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
  graphdef, params = nnx.split(conv)

  def loss(params, x, cache, seg):
    y, new_cache = short_conv(nnx.merge(graphdef, params), x, cache, seg)
    return jnp.sum(y * ct) + jnp.sum(new_cache**2), (y, new_cache)

  # A fresh function per trace: the setting is read while tracing and is not
  # part of JAX's trace cache key.
  grad = lambda: jax.value_and_grad(lambda *a: loss(*a), argnums=(0, 1, 2), has_aux=True)
  for s in (seg, None):
    want = jax.jit(grad())(params, x, cache, s)
    with cs.sequence_sharding(_mesh(n), "context"):
      got = jax.jit(grad())(params, x, cache, s)
      assert "ppermute" in str(jax.make_jaxpr(grad())(params, x, cache, s))
    _assert_close(got, want, f"conv, segments={s is not None}")
