"""MQAR (multi-query associative recall) with a small KDN.

    python -m experiments.train --config=configs/mqar.py:smoke --workdir=/tmp/kdn_mqar_smoke

Args (``configs/mqar.py:<arg>``): ``smoke`` (tiny CPU run, ~2 min on 2 cores), ``default`` (a larger
accelerator run). Further comma-separated tokens pick the mixer / initial-state strategy, e.g.
``configs/mqar.py:smoke,gla`` or ``configs/mqar.py:default,kdn_iso,state_passing``.
"""

from configs import common


def get_config(arg: str = "smoke"):
  preset, mixer, strategy = common.parse_arg(arg, ("smoke", "default"), "configs/mqar.py")

  c = common.base_config()
  c.data.kind = "mqar"
  c.train.initial_state = strategy
  if preset == "smoke":
    vocab = 64
    c.model = common.tiny_model(vocab, mixer=mixer, mlp_hidden=128)
    c.data.seq_len = 64
    common.cpu_data(c, batch=32, eval_batch=64, eval_examples=512)
    c.data.mqar.vocab_size = vocab
    c.data.mqar.num_kv_pairs = 8
    common.schedule(c, steps=400, lr=6e-3, warmup=40, checkpoint_every=200)
    c.train.log_every = 25
    c.train.eval_batches = 8
    c.optim.weight_decay = 0.0
    c.checkpoint.keep = 2
  else:
    vocab = 8192
    c.model = common.small_model(
      vocab, mixer=mixer, num_layers=2, num_heads=2, head_dim=128, mlp_hidden=512
    )
    c.data.seq_len = 512
    c.data.global_batch_size = 64
    c.data.mqar.vocab_size = vocab
    c.data.mqar.num_kv_pairs = 64
    common.schedule(c, steps=20000, lr=1e-3, warmup=1000)
    c.train.log_every = 100
    c.train.eval_every = 2000
  return c
