"""Passkey retrieval: train at a short length, evaluate length x depth past it.

    python -m experiments.train --config=configs/passkey.py:cpu --workdir=workdirs/passkey/kdn_diag/zero
    python -m experiments.train --config=configs/passkey.py:cpu_post,state_passing \\
        --config.train.init_from=workdirs/passkey/kdn_diag/zero \\
        --workdir=workdirs/passkey/kdn_diag/post_state_passing
    python -m experiments.evaluate --workdir=workdirs/passkey/kdn_diag/zero --suite=retrieval \\
        --retrieval_lengths=128,256,512,1024,2048,4096,8192 --retrieval_examples=32 --batch=32

Each example is filler tokens with ``KEY d_1..d_5`` at a uniformly drawn position and ``QUERY d_1..d_5`` at
the end (experiments/data/synthetic.py:passkey_example); the five digits after QUERY are scored. The
retrieval suite evaluates exact match (all five digits right) on a length x depth grid (depth = where KEY
sits, 0 = the first token, 1 = just before QUERY).

Arg ``<preset>[,<mixer>][,<initial_state>]``: ``cpu`` (2-layer tiny model at T=128, 1000 steps, ~1.5 CPU
minutes; exact match 1.0 in range), ``cpu_post`` (the ``cpu`` model post-trained 300 steps with a fresh
optimizer and the arg's strategy; give ``--config.train.init_from``), ``default`` (a larger accelerator run
at T=256).
"""

from experiments.runner import config_lib
from kdn_jax.models.config import model_config


def get_config(arg: str = "cpu"):
  preset, mixer, strategy = config_lib.parse_arg(
    arg, ("cpu", "cpu_post", "default"), "configs/passkey.py"
  )

  c = config_lib.base_config()
  c.data.kind = "passkey"
  c.train.initial_state = strategy
  c.data.passkey.digits = 5
  if preset in ("cpu", "cpu_post"):
    vocab = 64  # 1 = KEY, 2 = QUERY, 10..19 = digits, 20..63 = filler
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
    c.data.seq_len = 128
    c.data.global_batch_size = 16
    c.data.eval_batch_size = 64
    c.data.num_eval_examples = 256
    c.data.read_threads = 2
    c.train.log_every = 50
    c.train.eval_batches = 4
    c.optim.weight_decay = 0.0
    c.checkpoint.keep = 1
    if preset == "cpu":
      c.train.num_steps = 1000
      c.optim.learning_rate = 6e-3
      c.optim.warmup_steps = 50
      c.checkpoint.every_steps = 1000
    else:
      c.train.num_steps = 300
      c.optim.learning_rate = 1e-3
      c.optim.warmup_steps = 20
      c.checkpoint.every_steps = 300
  else:
    vocab = 256
    c.model = model_config(
      "20m",
      mixer=mixer,
      vocab_size=vocab,
      num_layers=4,
      d_model=256,
      num_heads=4,
      head_dim=64,
      mlp_hidden=512,
      dtype="bfloat16",
    )
    c.data.seq_len = 256
    c.data.global_batch_size = 64
    c.data.eval_batch_size = 64
    c.train.num_steps = 10000
    c.train.log_every = 100
    c.train.eval_every = 2000
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 500
    c.optim.weight_decay = 0.0
  c.data.passkey.vocab_size = vocab
  return c
