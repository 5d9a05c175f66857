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

from configs import common


def get_config(arg: str = "cpu"):
  preset, mixer, strategy = common.parse_arg(
    arg, ("cpu", "cpu_post", "default"), "configs/passkey.py"
  )

  c = common.base_config()
  c.data.kind = "passkey"
  c.train.initial_state = strategy
  c.data.passkey.digits = 5
  if preset in ("cpu", "cpu_post"):
    vocab = 64  # 1 = KEY, 2 = QUERY, 10..19 = digits, 20..63 = filler
    c.model = common.tiny_model(vocab, mixer=mixer, mlp_hidden=128)
    c.data.seq_len = 128
    common.cpu_data(c, batch=16, eval_batch=64, eval_examples=256)
    c.train.log_every = 50
    c.train.eval_batches = 4
    c.optim.weight_decay = 0.0
    c.checkpoint.keep = 1
    if preset == "cpu":
      common.schedule(c, steps=1000, lr=6e-3, warmup=50, checkpoint_every=1000)
    else:
      common.schedule(c, steps=300, lr=1e-3, warmup=20, checkpoint_every=300)
  else:
    vocab = 256
    c.model = common.small_model(vocab, mixer=mixer, mlp_hidden=512)
    c.data.seq_len = 256
    c.data.global_batch_size = 64
    c.data.eval_batch_size = 64
    common.schedule(c, steps=10000, lr=1e-3, warmup=500)
    c.train.log_every = 100
    c.train.eval_every = 2000
    c.optim.weight_decay = 0.0
  c.data.passkey.vocab_size = vocab
  return c
