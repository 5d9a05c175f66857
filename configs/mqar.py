"""MQAR (multi-query associative recall) with a small KDN.

    python -m experiments.train --config=configs/mqar.py:smoke --workdir=/tmp/kdn_mqar_smoke

Args (``configs/mqar.py:<arg>``): ``smoke`` (tiny CPU run, ~2 min on 2 cores), ``default`` (a larger
accelerator run). Further comma-separated tokens pick the mixer / initial-state strategy, e.g.
``configs/mqar.py:smoke,gla`` or ``configs/mqar.py:default,kdn_iso,state_passing``.
"""

from experiments.runner import config_lib
from kdn_jax.models.config import model_config


def get_config(arg: str = "smoke"):
  preset, mixer, strategy = config_lib.parse_arg(arg, ("smoke", "default"), "configs/mqar.py")

  c = config_lib.base_config()
  c.data.kind = "mqar"
  c.train.initial_state = strategy
  if preset == "smoke":
    vocab = 64
    c.model = model_config(
      "tiny",
      mixer=mixer,
      vocab_size=vocab,
      num_layers=2,
      d_model=64,
      num_heads=2,
      head_dim=32,
      chunk_size=16,
      mlp_hidden=128,
    )
    c.data.seq_len = 64
    c.data.global_batch_size = 32
    c.data.eval_batch_size = 64
    c.data.num_eval_examples = 512
    c.data.read_threads = 2
    c.data.mqar.vocab_size = vocab
    c.data.mqar.num_kv_pairs = 8
    c.train.num_steps = 400
    c.train.log_every = 25
    c.train.eval_batches = 8
    c.optim.learning_rate = 6e-3
    c.optim.warmup_steps = 40
    c.optim.weight_decay = 0.0
    c.checkpoint.every_steps = 200
    c.checkpoint.keep = 2
  else:
    vocab = 8192
    c.model = model_config(
      "20m",
      mixer=mixer,
      vocab_size=vocab,
      num_layers=2,
      d_model=256,
      num_heads=2,
      head_dim=128,
      mlp_hidden=512,
      dtype="bfloat16",
    )
    c.data.seq_len = 512
    c.data.global_batch_size = 64
    c.data.mqar.vocab_size = vocab
    c.data.mqar.num_kv_pairs = 64
    c.train.num_steps = 20000
    c.train.log_every = 100
    c.train.eval_every = 2000
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 1000
  return c
