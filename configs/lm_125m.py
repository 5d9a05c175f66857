"""Language modelling on token files (.npy memmaps of token ids).

    python -m experiments.train --config=configs/lm_125m.py --workdir=/ckpt/lm125m \\
        --config.data.train_path=/data/train.npy --config.data.eval_path=/data/val.npy

Arg (``configs/lm_125m.py:<preset>[,<mixer>][,<initial_state>]``): ``default`` (125M, bf16 compute, 2k
context) or ``smoke`` (tiny CPU variant; make a token file with
``python -m experiments.data.make_token_file /tmp/kdn_tokens.npy``). Examples:
``configs/lm_125m.py:default,gla``, ``configs/lm_125m.py:default,kdn_diag,state_passing``; for tbtt also set
``--config.data.eos_id``.
"""

from configs import common


def get_config(arg: str = "default"):
  preset, mixer, strategy = common.parse_arg(arg, ("default", "smoke"), "configs/lm_125m.py")

  c = common.base_config()
  c.data.kind = "token_file"
  c.train.initial_state = strategy
  if preset == "default":
    c.model = common.model_config("125m", mixer=mixer, dtype="bfloat16", param_dtype="float32")
    c.data.seq_len = 2048
    c.data.global_batch_size = 256
    c.data.eval_batch_size = 64
    c.data.num_eval_examples = 1024
    c.train.num_steps = 20000
    c.train.log_every = 50
    c.train.eval_every = 1000
    c.train.eval_batches = 16
    c.optim.learning_rate = 3e-3
    c.optim.warmup_steps = 1000
    c.optim.weight_decay = 0.1
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.checkpoint.every_steps = 1000
  else:
    c.model = common.model_config("tiny", mixer=mixer)
    c.data.train_path = "/tmp/kdn_tokens.npy"
    c.data.seq_len = 128
    c.data.global_batch_size = 16
    c.data.eval_batch_size = 16
    c.data.num_eval_examples = 64
    c.data.eos_id = 1
    c.train.num_steps = 200
    c.train.log_every = 20
    c.optim.learning_rate = 3e-3
    c.optim.warmup_steps = 20
    c.checkpoint.every_steps = 100
  return c
