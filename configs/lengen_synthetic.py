"""Length generalisation on the synthetic topic source (experiments/data/topic_source.py), whose
exact Bayes floor makes the excess NLL by position measurable.

    # CPU minutes: pretrain from the zero state at T=64, post-train with an intervention, evaluate
    python -m experiments.train --config=configs/lengen_synthetic.py:tiny,gla --workdir=/tmp/ls/gla
    python -m experiments.train --config=configs/lengen_synthetic.py:tiny_post,gla,tbtt \\
        --config.train.init_from=/tmp/ls/gla --workdir=/tmp/ls/gla_tbtt
    python -m experiments.evaluate --workdir=/tmp/ls/gla_tbtt --suite=topic_floor --max_len=8192
    # the whole study (every mixer x strategy, resumable): experiments/studies/lengen_synthetic/study.py

Arg ``<preset>[,<mixer>][,<initial_state>]`` (mixers: mamba2, gla, kda, kdn_diag, ...; initial
states: zero, state_passing, tbtt, fitted_noise, random_noise):
  ``tiny``       2 layers, d=64 (2 heads x 32), T=64, 300 steps of 16 x 64 tokens: CPU minutes.
  ``tiny_post``  the ``tiny`` model post-trained for 10% of its steps at lr 3e-4 with a fresh
                 optimizer and the arg's initial state (give ``--config.train.init_from``).
  ``default``    4 layers, d=256 (4 heads x 64), T=64, 5000 steps of 256 x 64 tokens (82M tokens),
                 lr 3e-3, 10% warm-up then cosine; checkpoints every 1250 steps, all kept (the
                 evaluation of each gives the trend with training tokens). One GPU.
  ``post``       the ``default`` model post-trained like ``tiny_post`` (500 steps).

The source: vocabulary 512 (+ BOS; the model's table is padded to a multiple of 64), 16 topics each
a Zipf(1.1) law over its own permutation, topic switch probability 1/2048 per token, documents of
65536 tokens. ``--config.data.topic.*`` changes it (the evaluation reads the run's own settings).
"""

from configs import common

PRESETS = ("tiny", "tiny_post", "default", "post")
POST_FRACTION = 0.1  # post-training steps / pretraining steps
POST_LR = 3e-4


def model_vocab(topic_vocab: int) -> int:
  """The model's table: the topic vocabulary and BOS, padded to a multiple of 64 (padding ids never
  occur)."""
  return -(-(topic_vocab + 1) // 64) * 64


def get_config(arg: str = "tiny"):
  preset, mixer, strategy = common.parse_arg(arg, PRESETS, "configs/lengen_synthetic.py")
  small = preset in ("tiny", "tiny_post")

  c = common.base_config()
  c.data.kind = "topic"
  c.train.initial_state = strategy
  vocab = model_vocab(int(c.data.topic.vocab_size))
  c.data.seq_len = 64
  if small:
    c.model = common.tiny_model(vocab, mixer=mixer)
    common.cpu_data(c, batch=16, eval_batch=32, eval_examples=128)
    c.data.topic.num_train_docs = 1024
    pre_steps = 300
    c.train.log_every = 25
    c.train.eval_batches = 4
    c.optim.learning_rate = 1e-2
    c.checkpoint.keep = 2
  else:
    c.model = common.small_model(vocab, mixer=mixer, param_dtype="float32")
    c.data.global_batch_size = 256
    c.data.eval_batch_size = 256
    c.data.num_eval_examples = 1024
    c.data.topic.num_train_docs = 16384
    pre_steps = 5000
    c.train.log_every = 100
    c.train.eval_batches = 4
    c.optim.learning_rate = 3e-3
    c.checkpoint.keep = 4
  c.optim.weight_decay = 0.1
  if preset in ("tiny", "default"):
    c.train.num_steps = pre_steps
    c.optim.warmup_steps = pre_steps // 10
    c.checkpoint.every_steps = pre_steps // 4
  else:  # post-training from a pretrained run (train.init_from): fresh optimizer, a small rate
    steps = int(pre_steps * POST_FRACTION)
    common.schedule(c, steps=steps, lr=POST_LR, warmup=steps // 10, checkpoint_every=steps)
  return c
