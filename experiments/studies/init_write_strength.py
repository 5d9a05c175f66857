"""Write strength at initialisation of the MQAR Zoology models: KDN's beta_eff = z / (r + z) against the
delta-rule baselines' beta = sigmoid(b_proj x), on training rows of the study's mixture (RESULTS.md
section 1 explains take-off with it).

    python -m experiments.studies.init_write_strength --out=docs/results/mqar_zoology/init_write_strength.json

Per width, mixer and seed: the write strength of a freshly initialised model (nothing trained), averaged
over layers, heads and every token of 32 training rows (padding excluded).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import mqar_zoology as zoo
from experiments import schema
from experiments.data import mqar_mixture
from experiments.evaluation import probes
from experiments.runner.logging_utils import write_json
from kdn_jax.models.lm import LanguageModel

MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet", "deltanet")


def _delta_betas(model, tokens) -> list[np.ndarray]:
  """beta [B, T, H] of every delta-rule layer (sigmoid of its projection) on ``tokens``."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    xs = m.mixer_inputs(tokens)
    return [blk.mixer.beta(x) for blk, x in zip(m.blocks, xs) if hasattr(blk.mixer, "beta")]

  return [np.asarray(b) for b in run(state, jnp.asarray(tokens, jnp.int32))]


def write_strength(width: int, mixer: str, seed: int, rows: int = 32) -> dict:
  c = zoo.get_config(f"d{width},{mixer}")
  model = LanguageModel(c.model, rngs=nnx.Rngs(seed))
  b = mqar_mixture.batch(
    seed * 1000 + 1,
    0,
    schema.mqar_mixture_cells(c),
    rows,
    c.data.seq_len,
    c.data.mqar.vocab_size,
    c.data.mqar.power_a,
  )
  # a row's tokens up to its cell's length (the padding is not part of any example)
  lengths = np.asarray([schema.mqar_mixture_cells(c)[k][0] for k in b["cell"]])
  keep = np.arange(c.data.seq_len)[None, :] < lengths[:, None]
  if mixer.startswith("kdn"):
    per_layer = list(probes.write_strengths(model, b["inputs"]).values())
  else:
    per_layer = _delta_betas(model, b["inputs"])
  means = [float(v[keep].mean()) for v in per_layer]
  return {"mean": float(np.mean(means)), "per_layer": means}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="docs/results/mqar_zoology/init_write_strength.json")
  p.add_argument("--widths", default=",".join(str(w) for w in zoo.WIDTHS))
  p.add_argument("--mixers", default=",".join(MIXERS))
  p.add_argument("--seeds", default="0,1,2")
  a = p.parse_args(argv)
  widths = [int(w) for w in a.widths.split(",")]
  seeds = [int(s) for s in a.seeds.split(",")]
  out = {
    "what": "mean write strength (KDN beta_eff = z / (r + z); delta-rule beta = sigmoid(b_proj x)) over "
    "layers, heads and the tokens of 32 training rows of the mixture",
    "seeds": seeds,
    "widths": {},
  }
  for w in widths:
    for m in a.mixers.split(","):
      got = [write_strength(w, m, s) for s in seeds]
      out["widths"].setdefault(str(w), {})[m] = {
        "mean": float(np.mean([g["mean"] for g in got])),
        "per_seed": [g["mean"] for g in got],
        "per_layer": np.mean([g["per_layer"] for g in got], axis=0).tolist(),
      }
      print(f"d{w} {m}: {out['widths'][str(w)][m]['mean']:.3f}", flush=True)
  write_json(a.out, out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
