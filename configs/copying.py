"""Copying with variable lengths (the second paper's copying protocol, scaled down).

    # CPU: warm up on short copies, pretrain from the zero state on copy lengths 50-100, then post-train
    python -m experiments.train --config=configs/copying.py:cpu_short --workdir=workdirs/copying/short
    python -m experiments.train --config=configs/copying.py:cpu --config.train.init_from=workdirs/copying/short \
        --workdir=workdirs/copying/pretrain
    python -m experiments.train --config=configs/copying.py:cpu_post,state_passing \
        --config.train.init_from=workdirs/copying/pretrain --workdir=workdirs/copying/state_passing
    python -m experiments.evaluate --workdir=workdirs/copying/state_passing --suite=retrieval \
        --retrieval_lengths=102,128,160,202,256,302,404,602,808

Each example is ``BOS x_1..x_L SEP x_1..x_L`` (then padding) with L drawn uniformly from
[``data.copying.min_copy_len``, ``data.copying.copy_len``] = [50, 100]; the copied half is scored (character
accuracy = token accuracy over it). Training sequences hold the longest copy: seq_len = 2 * 100 + 2. The
retrieval suite evaluates at length T with L = (T - 1) // 2 (the longest that fits), so T = 2L + 2 gives
L = 50 .. 403 for the lengths above (in range up to T = 202).

Arg ``<preset>[,<mixer>][,<initial_state>]``:
  ``cpu``        2-layer tiny model (2 heads of 64), copy lengths 50-100, 600 steps of 8 x 202 tokens
                 (~3 CPU minutes). From scratch it sits on the chance plateau for thousands of steps, so the
                 CPU protocol starts it from ``cpu_short`` (``--config.train.init_from``).
  ``cpu_short``  the same model on copy lengths 10-20 (seq_len 42), 1000 steps (~1 CPU minute): learns the
                 copy mechanism (val accuracy ~0.99), which ``cpu`` then stretches to 50-100.
  ``cpu_post``   the ``cpu`` model post-trained 300 steps with a fresh optimizer and the arg's initial-state
                 strategy (give ``--config.train.init_from``).
  ``default``    a larger accelerator run on 50-100 from scratch; ``post`` its post-training.

The copying study's runs (experiments/studies/copying/study.py) take ``<size>,<arm>,l<max>[,<initial_state>]``:
copy lengths drawn from [50, ``max``] (100: the paper's training range; 300: the capacity control),
seq_len 2 * max + 2, from scratch. Arms (ARMS): ``mamba2`` (mamba_ssm's Mamba-2 block and LM,
mamba2_variant='official') and ``kdn_diag``, sized by ``common.solve_shape`` to the non-embedding
count SIZES[size] (``tiny`` ~16k for CPU tests; 5m, 15m, 45m: the paper's Mamba-2 is 45M; the
count of each shape is ``non_embedding(arm, size)``). Training: batch BATCH[size] sequences, peak
LR[size], AdamW with weight decay 0.1 (none on A_log / dt_bias / D / norms), bf16 compute with fp32
parameters (``tiny``: fp32); the study sets steps, warm-up, seed and post-training.
"""

import functools

from configs import common

MIN_COPY, MAX_COPY = 50, 100
VOCAB = 32  # 29 symbols + pad/BOS/SEP

OFFICIAL = {"mixer": "mamba2", "mamba2_variant": "official"}
ARMS = {"mamba2": OFFICIAL, "kdn_diag": {"mixer": "kdn_diag"}}
SIZES = {"tiny": 16_000, "5m": 5_000_000, "15m": 15_000_000, "45m": 45_000_000}
# MLP-model layers (the official Mamba-2 LM has about twice as many blocks; common.solve_shape)
LAYERS = {"tiny": 1, "5m": 4, "15m": 6, "45m": 8}
HEAD = {"tiny": 16, "5m": 64, "15m": 64, "45m": 64}
BATCH = {"tiny": 8, "5m": 128, "15m": 128, "45m": 128}
LR = {"tiny": 1e-2, "5m": 2e-3, "15m": 1.5e-3, "45m": 1e-3}


@functools.lru_cache(maxsize=32)
def shape(arm: str, size: str) -> tuple:
  """The model keys of ``arm`` at ``size`` (sorted (key, value) pairs)."""
  return common.solve_shape(ARMS[arm], SIZES[size], LAYERS[size], HEAD[size])


def non_embedding(arm: str, size: str) -> int:
  return common.non_embedding_of(ARMS[arm], **dict(shape(arm, size)))


def parse_study(arg: str) -> tuple[str, str, int, str]:
  """'<size>,<arm>,l<max>[,<initial_state>]' -> (size, arm, max copy length, initial_state)."""
  parts = [p for p in arg.split(",") if p]
  where = f"configs/copying.py:{arg}"
  if len(parts) not in (3, 4):
    raise common.ConfigError(f"{where}: expected <size>,<arm>,l<max>[,<initial_state>]")
  size, arm, top, *rest = parts
  if arm not in ARMS:
    raise common.ConfigError(f"{where}: unknown arm {arm!r}; expected one of {list(ARMS)}")
  if not (top.startswith("l") and top[1:].isdigit() and int(top[1:]) > MIN_COPY):
    raise common.ConfigError(
      f"{where}: expected the longest training copy as l<max> with max > {MIN_COPY}, got {top!r}"
    )
  strategy = rest[0] if rest else "zero"
  if strategy not in common.INITIAL_STATES:
    raise common.ConfigError(
      f"{where}: unknown initial state {strategy!r}; expected one of {common.INITIAL_STATES}"
    )
  return size, arm, int(top[1:]), strategy


def study_config(arg: str):
  size, arm, top, strategy = parse_study(arg)
  tiny = size == "tiny"
  c = common.base_config()
  c.data.kind = "copying"
  c.data.seq_len = 2 * top + 2
  c.data.copying.copy_len = top
  c.data.copying.min_copy_len = MIN_COPY
  c.data.copying.vocab_size = VOCAB
  c.data.global_batch_size = BATCH[size]
  c.train.initial_state = strategy
  c.train.state_reset_prob = 0.1  # state passing: each row restarts from zero with this chance
  c.model = common.sized_model(VOCAB, tiny, {**ARMS[arm], **dict(shape(arm, size))})
  common.sized_run(c, tiny, LR[size], eval_examples=8 if tiny else 512)
  return c


def get_config(arg: str = "cpu"):
  if (arg or "").split(",")[0] in SIZES:
    return study_config(arg)
  preset, mixer, strategy = common.parse_arg(
    arg, ("cpu", "cpu_short", "cpu_post", "default", "post"), "configs/copying.py"
  )

  c = common.base_config()
  c.data.kind = "copying"
  c.train.initial_state = strategy
  c.data.seq_len = 2 * MAX_COPY + 2
  c.data.copying.copy_len = MAX_COPY
  c.data.copying.min_copy_len = MIN_COPY
  if preset.startswith("cpu"):
    vocab = 32  # 29 symbols + pad/BOS/SEP
    c.model = common.tiny_model(vocab, mixer=mixer, head_dim=64, mlp_hidden=128)
    common.cpu_data(c, batch=8, eval_batch=32, eval_examples=128)
    c.train.log_every = 50
    c.train.eval_batches = 4
    c.optim.weight_decay = 0.0
    c.checkpoint.keep = 1
    if preset == "cpu_short":
      c.data.seq_len = 2 * 20 + 2
      c.data.copying.copy_len = 20
      c.data.copying.min_copy_len = 10
      common.schedule(c, steps=1000, lr=6e-3, warmup=50)
    elif preset == "cpu":
      common.schedule(c, steps=600, lr=3e-3, warmup=30)
    else:
      common.schedule(c, steps=300, lr=1e-3, warmup=20)
    c.checkpoint.every_steps = c.train.num_steps
  else:
    vocab = 64
    c.model = common.small_model(vocab, mixer=mixer, mlp_hidden=512)
    c.data.global_batch_size = 64
    c.data.eval_batch_size = 64
    c.data.copying.vocab_size = vocab
    c.train.log_every = 100
    c.optim.weight_decay = 0.0
    if preset == "default":
      common.schedule(c, steps=20000, lr=1e-3, warmup=1000)
      c.train.eval_every = 2000
    else:
      common.schedule(c, steps=2000, lr=3e-4, warmup=100)
  c.data.copying.vocab_size = vocab
  return c
