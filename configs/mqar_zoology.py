"""MQAR the Zoology way: one model trained on a mixture of (length, pairs) cells, tested on longer ones.

    python -m experiments.train --config=configs/mqar_zoology.py:d64,kda --workdir=/tmp/zoology/d64/kda
    python -m experiments.studies.mqar_zoology --runs=/tmp/zoology --widths=64 --mixers=kdn_diag,kda

Arg ``d<width>,<mixer>[,tiny]``. Each process trains every learning rate x seed of one (width, mixer) at
once (``train.lr_sweep`` x ``train.seeds``, experiments/runner/lr_sweep.py): 2 layers of short
convolutions + mixer + SwiGLU, the MLP width matched to diagonal KDN's parameters
(``kdn_jax.models.config.matched_mlp_hidden``). Training rows come from ``TRAIN_CELLS`` (Zoology's
five training sets, weighted by their sizes 100k : 20k : 20k : 20k : 20k), each right-padded to 256
with its loss masked; evaluation (experiments/studies/mqar_zoology_sweep.py) runs every member on
``TEST_CELLS`` (a validation split picks the learning rate, a test split is reported).

Budget knobs: ``--config.train.num_steps`` (warm-up stays 10% of it) and
``--config.data.global_batch_size``. Zoology trains ~180k examples x 32-64 epochs at batch 256 (~20k+
steps); the defaults here are that order, the study's --num_steps/--batch pick what a GPU budget allows.
``tiny``: a CPU-sized variant (small vocabulary and cells, 30 steps) that checks the whole study runs.
"""

import re

from configs import common

WIDTHS = (64, 128, 256)
MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet", "deltanet", "gla")
LEARNING_RATES = (1e-3, 3.2e-3, 1e-2, 3.2e-2)
SEEDS = "0,1,2"
NUM_HEADS = 2
VOCAB = 8192
TRAIN_CELLS = "64:4:5,128:8:1,256:16:1,256:32:1,256:64:1"  # <seq_len>:<pairs>:<weight>
TEST_CELLS = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))
VALIDATION_EXAMPLES, TEST_EXAMPLES = 256, 1000
# generator seeds of the evaluation splits (the training stream of seed s is the mixture generator's
# s * 1000 + 1, a different generator altogether)
VALIDATION_SEED, TEST_SEED = 1_000_001, 1_000_002
STEPS = 20_000
BATCH = 256

# (test cells of one padded length: one compiled scoring pass; the reference impl compiles fastest on CPU)
TINY = {
  "vocab": 64,
  "train_cells": "16:2:2,32:4:1",
  "test_cells": ((16, 2), (32, 4), (32, 8)),
  "steps": 30,
  "batch": 8,
  "validation_examples": 16,
  "test_examples": 24,
  "impl": "reference",
}


def parse_arg(arg: str) -> tuple[int, str, bool]:
  """'d64,kda[,tiny]' -> (64, 'kda', False)."""
  parts = [p for p in (arg or "d64,kdn_diag").split(",") if p]
  tiny = "tiny" in parts
  rest = [p for p in parts if p != "tiny"]
  m = re.fullmatch(r"d(\d+)", rest[0]) if rest else None
  if not m or len(rest) > 2 or (len(rest) == 2 and rest[1] not in MIXERS):
    raise common.ConfigError(
      f"configs/mqar_zoology.py:{arg}: expected d<width>,<mixer>[,tiny] with a "
      f"mixer from {', '.join(MIXERS)}"
    )
  width = int(m.group(1))
  if width % (NUM_HEADS * 8):
    raise common.ConfigError(
      f"configs/mqar_zoology.py:{arg}: width {width} must be a multiple of "
      f"{NUM_HEADS * 8} ({NUM_HEADS} heads of a multiple of 8)"
    )
  return width, (rest[1] if len(rest) == 2 else "kdn_diag"), tiny


def test_cells(tiny: bool = False) -> tuple:
  return TINY["test_cells"] if tiny else TEST_CELLS


def get_config(arg: str = "d64,kdn_diag"):
  width, mixer, tiny = parse_arg(arg)
  c = common.base_config()
  c.data.kind = "mqar"
  vocab = TINY["vocab"] if tiny else VOCAB
  c.model = common.model_config(
    "tiny",
    mixer=mixer,
    vocab_size=vocab,
    num_layers=2,
    d_model=width,
    num_heads=NUM_HEADS,
    head_dim=width // NUM_HEADS,
    chunk_size=16 if tiny else 64,
    mlp_hidden=2 * width,
    mlp_multiple=8,
  )
  if tiny:
    c.model.impl = TINY["impl"]
  c.model.mlp_hidden = common.matched_mlp_hidden(c.model, 2 * width)
  c.model.mlp_reference, c.model.mlp_matched = 2 * width, c.model.mlp_hidden
  c.data.mqar.vocab_size = vocab
  c.data.mqar.mixture = TINY["train_cells"] if tiny else TRAIN_CELLS
  cells = common.mqar_mixture_cells(c)
  c.data.seq_len = max(t for t, _, _ in cells)
  c.data.mqar.num_kv_pairs = max(n for _, n, _ in cells)
  c.data.global_batch_size = TINY["batch"] if tiny else BATCH
  c.data.eval_batch_size = c.data.global_batch_size
  c.data.num_eval_examples = 2 * c.data.global_batch_size
  c.data.read_threads = 1
  c.train.loss_positions = c.data.mqar.num_kv_pairs  # logits only at the scored queries
  c.train.lr_sweep = LEARNING_RATES
  c.train.seeds = SEEDS
  c.train.num_steps = TINY["steps"] if tiny else STEPS
  c.train.log_every = 10 if tiny else 100
  c.train.eval_every = 0
  c.train.eval_batches = 2
  c.optim.learning_rate = LEARNING_RATES[0]  # (unused by a sweep: each member has its rate)
  c.optim.warmup_steps = c.train.get_ref("num_steps") // 10
  c.optim.weight_decay = 0.1
  c.checkpoint.every_steps = 0 if tiny else 1000
  c.checkpoint.keep = 1
  c.logging.tensorboard = False
  c.logging.plot = False
  return c
