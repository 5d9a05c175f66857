r"""Which [B,T,H,K]-sized arrays a recurrent layer's forward+backward puts at kernel boundaries:
every pallas_call of the layer's gradient program with the dtypes of its [B,T,H,K] operands and
results (tiny shapes, CPU; read off `jax.make_jaxpr`, so XLA's fusions in between are not seen).
Shows which fp32 arrays the fused glue kernels keep out of HBM (docs/decisions.md).

  python -m experiments.benchmarks.layer_boundaries --mixer=kdn_diag --fusion=off    # plain-JAX glue
  python -m experiments.benchmarks.layer_boundaries --mixer=kdn_diag --fusion=on     # fused glue
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from jax._src import core as jax_core

FLAGS = flags.FlagValues()
flags.DEFINE_string("mixer", "kdn_diag", "registry.MIXERS name", flag_values=FLAGS)
flags.DEFINE_string(
  "fusion", "on", "benchmark_layers.set_fusion: on, off, front, conv, norm", flag_values=FLAGS
)

B, T, H, K, D = 1, 64, 2, 16, 32  # T = 64: a multiple of every kernel block (no padding)


def _sub_jaxprs(params):
  for v in params.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(x, jax_core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax_core.Jaxpr):
        yield x


def kernel_boundaries(mixer, fusion):
  """[(kernel name, operand dtypes, result dtypes)] of [B,T,H,K]-shaped arrays, in program order."""
  from experiments.benchmarks.layers import set_fusion
  from kdn_jax.layers.registry import MIXERS
  from kdn_jax.models.config import model_config

  cfg = model_config(
    "tiny",
    d_model=D,
    num_heads=H,
    head_dim=K,
    mixer=mixer,
    impl="pallas",
    chunk_size=16,
    dtype="bfloat16",
    param_dtype="float32",
    mlp_hidden=1,
  )
  layer = MIXERS[mixer](cfg, rngs=nnx.Rngs(0))
  set_fusion(layer, fusion)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0].astype(jnp.float32))
  program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(
    params, jnp.ones((B, T, D), jnp.bfloat16)
  )
  big = lambda a: len(a.shape) == 4 and a.shape[1] == T and a.shape[2] == H
  found = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        dt = lambda vs: [str(v.aval.dtype) for v in vs if hasattr(v, "aval") and big(v.aval)]
        name = str(e.params.get("name_and_src_info", e.params.get("name"))).split(" ")[0]
        found.append((name, dt(e.invars), dt(e.outvars)))
        continue
      for sub in _sub_jaxprs(e.params):
        walk(sub)

  walk(program.jaxpr)
  return found


def main(argv):
  del argv
  for name, ins, outs in kernel_boundaries(FLAGS.mixer, FLAGS.fusion):
    print(f"{name:28s} in {ins} out {outs}")


if __name__ == "__main__":
  FLAGS(["layer_boundaries"] + __import__("sys").argv[1:])
  app.run(main, argv=["layer_boundaries"])
