"""Short-context text LMs for the length-generalisation study (experiments/studies/lengen_text/study.py):
small models trained from the zero state at T = 64 or 128 on the prepared corpus, post-trained
with an initial-state intervention, evaluated far past T.

    python -m experiments.data.prepare --out=/tmp/kdn_corpus
    python -m experiments.train --config=configs/lengen_short.py:t64,mamba2 --workdir=/ckpt/m2
    python -m experiments.train --config=configs/lengen_short.py:post,mamba2,state_passing \\
        --config.train.init_from=/ckpt/m2 --workdir=/ckpt/m2_sp
    python -m experiments.evaluate --workdir=/ckpt/m2 --all_steps --suite=position_ppl,effrem \\
        --max_len=8192 --chunk=512 --num_sequences=64

Arg ``<preset>[,<arm>][,<initial_state>]``. Arms (ARMS): ``mamba2`` (Mamba-2's own block,
mamba2_variant='faithful', dt in [1e-3, 1e-1]), ``mamba2_long`` (the same with dt in [1e-4, 1e-2]:
time constants 10x longer at init), ``mamba2_normalized`` (the scaffold form),
``mamba2_official`` / ``mamba2_official_long`` (mamba_ssm's Mamba2 block and LM, no MLP:
mamba2_variant='official', the two dt ranges; any preset with ``--config.model.mixer=mamba2
--config.model.mamba2_variant=official`` is the same), ``gla``, ``kda``,
``kdn_diag``, or any other mixer name. The dt range of any arm: ``--config.model.dt_min`` /
``dt_max`` (and ``a_min`` / ``a_max``). Initial states: zero, state_passing, tbtt, fitted_noise,
random_noise.

  ``t64``        4 layers, d=256, 4 heads x 64, the corpus's 16k vocabulary, tied embedding (~7.8M
                 parameters, 3.6M non-embedding), T=64, batch 256, 5000 steps (82M tokens), lr 3e-3,
                 10% warm-up then cosine; checkpoints kept at 1000 / 2500 / 5000 (the trend with
                 training tokens). One GPU (four arms share one H100).
  ``t128``       the same model at T=128, batch 128 (the same tokens per step and in all).
  ``post``       a ``t64`` model post-trained for 10% of its steps (500) at lr 3e-4 with a fresh
                 optimizer and the arg's initial state (give ``--config.train.init_from``).
  ``t128_post``  likewise for ``t128``.
  ``tiny``       2 layers, d=64 (2 heads x 32), T=16, 40 steps of 8 x 16 tokens: CPU seconds (with
                 a small corpus; the study's ``--toy_corpus`` writes one).
  ``tiny_post``  the ``tiny`` model post-trained likewise.
"""

from configs import common

VOCAB = 16384  # experiments/data/prepare.py --vocab_size
PRESETS = ("t64", "t128", "post", "t128_post", "tiny", "tiny_post")
PRETRAIN = {"post": "t64", "t128_post": "t128", "tiny_post": "tiny"}
POST_FRACTION = 0.1  # post-training steps / pretraining steps
POST_LR = 3e-4
LONG_DT = {"dt_min": 1e-4, "dt_max": 1e-2}
ARMS = {
  "mamba2": {"mixer": "mamba2", "mamba2_variant": "faithful"},
  "mamba2_long": {"mixer": "mamba2", "mamba2_variant": "faithful", **LONG_DT},
  "mamba2_normalized": {"mixer": "mamba2", "mamba2_variant": "normalized"},
  "mamba2_official": {"mixer": "mamba2", "mamba2_variant": "official"},
  "mamba2_official_long": {"mixer": "mamba2", "mamba2_variant": "official", **LONG_DT},
}
# preset: (T, batch, pretraining steps, kept checkpoint steps)
SHAPES = {
  "t64": (64, 256, 5000, (1000, 2500, 5000)),
  "t128": (128, 128, 5000, (1000, 2500, 5000)),
  "tiny": (16, 8, 40, (20, 40)),
}


def arm_model_keys(arm: str) -> dict:
  """The model config keys of an arm (a mixer name is an arm of its own)."""
  if arm in ARMS:
    return dict(ARMS[arm])
  if arm in common.MIXERS:
    return {"mixer": arm}
  raise common.ConfigError(
    f"configs/lengen_short.py: unknown arm {arm!r}; expected one of {list(ARMS)} or a mixer "
    f"({', '.join(common.MIXERS)})"
  )


def parse(arg: str) -> tuple[str, str, str]:
  """'<preset>[,<arm>][,<initial_state>]' -> (preset, arm, initial_state)."""
  parts = [p for p in (arg or PRESETS[0]).split(",") if p]
  arms = [p for p in parts[1:] if p in ARMS]
  rest = ",".join([parts[0]] + [p for p in parts[1:] if p not in ARMS])
  preset, mixer, strategy = common.parse_arg(rest, PRESETS, "configs/lengen_short.py")
  named_mixer = any(p in common.MIXERS and p not in ARMS for p in parts[1:])
  if len(arms) + named_mixer > 1:
    raise common.ConfigError(f"configs/lengen_short.py:{arg}: give at most one arm")
  return preset, (arms[0] if arms else mixer), strategy


def get_config(arg: str = "t64"):
  preset, arm, strategy = parse(arg)
  base = PRETRAIN.get(preset, preset)
  seq_len, batch, pre_steps, keep_steps = SHAPES[base]
  small = base == "tiny"

  c = common.base_config()
  c.data.kind = "token_file"
  c.data.corpus_dir = "/tmp/kdn_corpus"
  c.data.seq_len = seq_len
  c.data.global_batch_size = batch
  c.train.initial_state = strategy
  keys = arm_model_keys(arm)
  if small:
    c.model = common.tiny_model(VOCAB, **keys)
    common.cpu_data(c, batch=batch, eval_batch=8, eval_examples=32)
    c.train.log_every = 10
    c.train.eval_batches = 2
    c.optim.learning_rate = 1e-2
    c.logging.plot = c.logging.tensorboard = False
  else:
    c.model = common.small_model(VOCAB, param_dtype="float32", **keys)
    c.data.eval_batch_size = 256
    c.data.num_eval_examples = 2048
    c.train.log_every = 100
    c.train.eval_batches = 8
    c.optim.learning_rate = 3e-3
  c.optim.weight_decay = 0.1
  c.checkpoint.keep = 1
  if preset == base:
    c.train.num_steps = pre_steps
    c.optim.warmup_steps = pre_steps // 10
    c.train.eval_every = keep_steps[0]
    c.checkpoint.every_steps = max(1, pre_steps // 10)  # resumable; only keep_steps stay
    c.checkpoint.keep_steps = ",".join(str(s) for s in keep_steps)
  else:  # post-training from a pretrained run (train.init_from): fresh optimizer, a small rate
    steps = max(1, round(pre_steps * POST_FRACTION))
    common.schedule(c, steps=steps, lr=POST_LR, warmup=steps // 10, checkpoint_every=steps)
  return c
