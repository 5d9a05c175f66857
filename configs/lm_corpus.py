"""Language modelling on the prepared text corpus (experiments/data/prepare.py), the papers' protocol.

    python -m experiments.data.prepare --out=/tmp/kdn_corpus
    python -m experiments.train --config=configs/lm_corpus.py:smoke --workdir=/tmp/kdn_lm_smoke
    # GPU: pretrain at T=512 from the zero state, then post-train with an intervention (second paper)
    python -m experiments.train --config=configs/lm_corpus.py:default,kda --workdir=/ckpt/kda_pre
    python -m experiments.train --config=configs/lm_corpus.py:post,kda,state_passing \\
        --config.train.init_from=/ckpt/kda_pre --workdir=/ckpt/kda_sp

Arg ``<preset>[,<mixer>][,<initial_state>]``: ``smoke`` (tiny, CPU minutes), ``default`` (a ~30M model,
T=512, 2000 steps of 32 x 512 tokens, one GPU), ``post`` (the default model post-trained for 300 steps
with a fresh optimizer; give ``--config.train.init_from``). ``--config.data.corpus_dir`` points at the
corpus (default /tmp/kdn_corpus); its manifest gives the token files and the EOS id, documents are
packed with segment_ids.
"""

from configs import common

VOCAB = 16384  # experiments/data/prepare.py --vocab_size


def get_config(arg: str = "smoke"):
  preset, mixer, strategy = common.parse_arg(
    arg, ("smoke", "default", "post"), "configs/lm_corpus.py"
  )

  c = common.base_config()
  c.data.kind = "token_file"
  c.data.corpus_dir = "/tmp/kdn_corpus"
  c.train.initial_state = strategy
  if preset == "smoke":
    c.model = common.tiny_model(VOCAB, mixer=mixer, d_model=128, head_dim=64)
    # 120 steps of 16 x 128 tokens (246k): a few minutes on 2 CPU cores (README); the tied 16k x 128
    # output projection is 85% of the model's FLOPs, so fewer tokens, not a smaller mixer, is what
    # shortens it
    c.data.seq_len = 128
    common.cpu_data(c, batch=16, eval_batch=16, eval_examples=128)
    c.train.num_steps = 120
    c.train.log_every = 20
    c.train.eval_batches = 8
    c.optim.learning_rate = (
      1e-2  # tied 16k x 128 embedding: a high rate learns the bigram statistics fast
    )
    c.optim.warmup_steps = 12
    c.checkpoint.every_steps = 60
    c.checkpoint.keep = 2
    return c
  # ~30M parameters (8.4M of them the tied embedding), MLP width matched across mixers
  c.model = common.model_config(
    "30m", mixer=mixer, vocab_size=VOCAB, dtype="bfloat16", param_dtype="float32"
  )
  c.data.seq_len = 512
  c.data.global_batch_size = 32
  c.data.eval_batch_size = 32
  c.data.num_eval_examples = 512
  c.train.log_every = 50
  c.train.eval_batches = 16
  c.optim.weight_decay = 0.1
  c.checkpoint.keep = 2
  if preset == "default":
    c.train.num_steps = 2000
    c.train.eval_every = 500
    c.optim.learning_rate = 2e-3
    c.optim.warmup_steps = 200
    c.checkpoint.every_steps = 500
  else:  # post-training: a few hundred steps from a pretrained run (train.init_from)
    c.train.num_steps = 300
    c.optim.learning_rate = 5e-4
    c.optim.warmup_steps = 30
    c.checkpoint.every_steps = 300
  return c
