"""MQAR grid (the KDN paper's synthetic recall at small scale; docs/RESULTS.md section 1).

One cell of the grid per run: 2-layer models, d_model in {64, 128}, (sequence length, key-value pairs) in
{(256, 16), (256, 64), (512, 64)}, mixers parameter-matched to diagonal KDN. The learning rate is the
grid's third axis, set with ``--config.optim.learning_rate``; ``python -m experiments.studies.mqar_grid`` runs the
whole grid (3 learning rates per cell) and keeps the best rate per cell.

    python -m experiments.train --config=configs/mqar_grid.py:d64_t256_kv16,kda \\
        --config.optim.learning_rate=3e-3 --workdir=/tmp/mqar/d64_t256_kv16/kda/lr3e-3

Arg: ``<cell>[,<mixer>][,cpu]`` with ``<cell>`` = ``d<d_model>_t<seq_len>_kv<pairs>``; ``cpu`` is a tiny
variant (small vocabulary, 60 steps) that checks a cell runs.
"""

import re

from configs import common

D_MODELS = (64, 128)
TASKS = ((256, 16), (256, 64), (512, 64))  # (sequence length, key-value pairs)
CELLS = tuple(f"d{d}_t{t}_kv{kv}" for d in D_MODELS for t, kv in TASKS)
MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet", "deltanet", "gla")
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
NUM_HEADS = 2
VOCAB = 8192  # Zoology's MQAR vocabulary: keys from [1, 4096), values from [4096, 8192)
STEPS = 2000
BATCH = 64


def parse_cell(cell: str) -> tuple[int, int, int]:
  """'d64_t256_kv16' -> (64, 256, 16)."""
  m = re.fullmatch(r"d(\d+)_t(\d+)_kv(\d+)", cell)
  if not m:
    raise ValueError(
      f"configs/mqar_grid.py: cell {cell!r} is not d<d_model>_t<seq_len>_kv<pairs>; "
      f"the grid has {', '.join(CELLS)}"
    )
  return tuple(int(g) for g in m.groups())


def get_config(arg: str = "d64_t256_kv16"):
  parts = [p for p in (arg or CELLS[0]).split(",") if p]
  cpu = "cpu" in parts
  rest = ",".join(p for p in parts[1:] if p != "cpu")
  d_model, seq_len, kv = parse_cell(parts[0])
  _, mixer, strategy = common.parse_arg(f"grid,{rest}", ("grid",), "configs/mqar_grid.py")

  c = common.base_config()
  c.data.kind = "mqar"
  c.train.initial_state = strategy
  vocab = 4 * kv + 64 if cpu else VOCAB
  head_dim = d_model // NUM_HEADS
  # The reference budget is diagonal KDN with a 2 x d_model SwiGLU; every mixer's MLP width is matched to
  # it (model_config only matches against its size presets' widths, so match here explicitly).
  c.model = common.model_config(
    "tiny",
    mixer=mixer,
    vocab_size=vocab,
    num_layers=2,
    d_model=d_model,
    num_heads=NUM_HEADS,
    head_dim=head_dim,
    chunk_size=64,
    mlp_hidden=2 * d_model,
    mlp_multiple=8,
  )
  c.model.mlp_hidden = common.matched_mlp_hidden(c.model, 2 * d_model)
  c.model.mlp_reference, c.model.mlp_matched = 2 * d_model, c.model.mlp_hidden
  c.data.seq_len = seq_len
  c.data.global_batch_size = 16 if cpu else BATCH
  c.data.eval_batch_size = 32 if cpu else 128
  c.data.num_eval_examples = 64 if cpu else 1024
  c.data.read_threads = 2
  c.data.mqar.vocab_size = vocab
  c.data.mqar.num_kv_pairs = kv
  c.train.loss_positions = (
    kv  # logits only at the kv scored queries: the same loss, ~T/kv x less memory
  )
  c.train.num_steps = 60 if cpu else STEPS
  c.train.log_every = 20 if cpu else 250
  c.train.eval_every = 0
  c.train.eval_batches = 2 if cpu else 8
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 6 if cpu else STEPS // 10
  c.optim.weight_decay = 0.1
  c.checkpoint.every_steps = 0 if cpu else STEPS // 2
  c.checkpoint.keep = 1
  return c
