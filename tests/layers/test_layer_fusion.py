"""The KDN layer's fused pieces against the plain-JAX composition they replace (CPU, interpret
mode): the gate front-end inside the gain kernels (KDNMixer.fuse_front) and the q/k/v short convs
as Pallas kernels (fuse_conv), the gated output norm as one (fuse_norm). Outputs, final states (conv caches included)
and the gradients of every parameter and of the input, with packed segments, a non-trivial
initial state and T not a multiple of any block."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdn_jax.layers import MIXERS
from kdn_jax.models.config import model_config


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30)))


def _layer(name, **kw):
  cfg = model_config(
    "tiny", mixer=name, d_model=32, num_heads=2, head_dim=16, impl="pallas", chunk_size=16, **kw
  )
  return MIXERS[name](cfg, rngs=nnx.Rngs(0))


def _state(layer, batch, seed=2):
  """A random state of the layer's structure (positive variance)."""
  leaves, tdef = jax.tree.flatten_with_path(layer.init_state(batch))
  rng = np.random.default_rng(seed)
  out = [
    jnp.asarray(
      rng.uniform(0.2, 2.0, x.shape)
      if "variance" in jax.tree_util.keystr(p)
      else 0.3 * rng.standard_normal(x.shape),
      jnp.float32,
    )
    for p, x in leaves
  ]
  return jax.tree.unflatten(tdef, out)


def _outputs_and_grads(layer, x, state, seg, ct):
  """(y, final state) and the gradients of sum(y * ct) + sum(final memory) w.r.t. params and x."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    y, fs = nnx.merge(graphdef, params, rest)(x, initial_state=state, segment_ids=seg)
    conv = sum(jnp.sum(c * c) for c in jax.tree.leaves(fs["conv"]))
    return (
      jnp.sum(y.astype(jnp.float32) * ct) + jnp.sum(fs["memory"]) + jnp.sum(fs["variance"]) + conv,
      (y, fs),
    )

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


@pytest.fixture
def chunked_memory(monkeypatch):
  """Both paths' memory update in XLA (chunked) instead of the interpreted delta-rule kernels:
  the same function on both sides, and the interpreted kernels' compile is most of the cost."""
  # the modules (kdn_jax.ops re-exports functions under the same names)
  delta_mod = importlib.import_module("kdn_jax.ops.delta_rule")
  kdn_mod = importlib.import_module("kdn_jax.ops.kdn")
  real = delta_mod.run_memory

  def run_memory(op, impl, *args):
    return real(op, "chunked" if impl == "pallas" else impl, *args)

  monkeypatch.setattr(delta_mod, "run_memory", run_memory)
  monkeypatch.setattr(kdn_mod, "run_memory", run_memory)


# kdn_diag only (suite time): iso's gain with the front-end is held to the composition in
# test_pallas_gain_fused.py, and its bf16 layer (write = beta k), fused and unfused, against float32 by
# experiments/benchmarks/check_fusion.py.
@pytest.mark.parametrize("name", ["kdn_diag"])
def test_fused_layer_matches_composition(name, chunked_memory):
  B, T = 2, 19  # 19: past one 16-token chunk, not a multiple of it
  layer = _layer(name, info_scale="learned")
  rng = np.random.default_rng(0)
  # nonzero gate projections' second layers (omega's is zero-initialised)
  _, params, _ = nnx.split(layer, nnx.Param, ...)
  nnx.update(
    layer,
    jax.tree.map(lambda p: p + 0.05 * jnp.asarray(rng.standard_normal(p.shape), p.dtype), params),
  )
  x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
  seg = jnp.asarray(np.repeat([[0] * 7 + [1] * 5 + [2] * 7], B, 0), jnp.int32)
  state = _state(layer, B)
  got = _outputs_and_grads(layer, x, state, seg, ct)
  assert layer._fused_front(layer._gates(x)) and layer._fused_conv() and layer._fused_norm()  # pylint: disable=protected-access
  layer.fuse_front = layer.fuse_conv = layer.fuse_norm = False
  want = _outputs_and_grads(layer, x, state, seg, ct)
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves(want)
  errs = {jax.tree_util.keystr(p): _rel(g, w) for (p, g), w in zip(flat_got, flat_want)}
  bad = {k: e for k, e in errs.items() if not e <= 2e-5}
  assert not bad, bad
