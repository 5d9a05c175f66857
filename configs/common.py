"""What the experiment configs share; each config in this folder imports this module alone (the
big_vision rule): the base run config and its arg grammar, and the two model sizes and the CPU data
settings that the synthetic and text studies repeat.

The sizes are the ones every study's numbers were measured with, so a change here changes them all:
``tiny_model`` (2 layers, d=64, 2 heads of 32, chunks of 16: CPU minutes) and ``small_model`` (4
layers, d=256, 4 heads of 64, bf16 compute: ~20M parameters, an accelerator's run). ``solve_shape``
sizes a model to a non-embedding parameter count (the studies that compare mixers at one count).
"""

from experiments.schema import (  # noqa: F401 (re-exported for the configs)
  INITIAL_STATES,
  MIXERS,
  ConfigError,
  base_config,
  mqar_mixture_cells,
  parse_arg,
)
from kdn_jax.layers import mamba2_official  # noqa: F401 (its state shape)
from kdn_jax.models.config import (  # noqa: F401
  analytic_non_embedding,
  matched_mlp_hidden,
  model_config,
)


def tiny_model(vocab_size: int, **keys):
  """The CPU presets' model; ``keys`` (mixer, head_dim, mlp_hidden, ...) override the size."""
  size = dict(num_layers=2, d_model=64, num_heads=2, head_dim=32, chunk_size=16)
  return model_config("tiny", vocab_size=vocab_size, **{**size, **keys})


def small_model(vocab_size: int, **keys):
  """The accelerator presets' ~20M model; ``keys`` override as in ``tiny_model``."""
  size = dict(num_layers=4, d_model=256, num_heads=4, head_dim=64, dtype="bfloat16")
  return model_config("20m", vocab_size=vocab_size, **{**size, **keys})


def cpu_data(c, *, batch: int, eval_batch: int, eval_examples: int):
  """A CPU preset's batches: two reader threads (the machines it targets have two cores)."""
  c.data.global_batch_size = batch
  c.data.eval_batch_size = eval_batch
  c.data.num_eval_examples = eval_examples
  c.data.read_threads = 2


def schedule(c, *, steps: int, lr: float, warmup: int, checkpoint_every: int | None = None):
  """Steps, peak rate and warmup; a checkpoint every ``checkpoint_every`` steps when given."""
  c.train.num_steps = steps
  c.optim.learning_rate = lr
  c.optim.warmup_steps = warmup
  if checkpoint_every is not None:
    c.checkpoint.every_steps = checkpoint_every


MLP_RATIO = 8 / 3  # the SwiGLU width / d_model that solve_shape stays nearest


def non_embedding_of(arm_keys: dict, **keys) -> int:
  """The analytic non-embedding count of a model with ``arm_keys`` (mixer, variant) and ``keys``."""
  return analytic_non_embedding(model_config("tiny", **arm_keys, **keys))


def solve_shape(arm_keys: dict, target: int, layers: int, head: int) -> tuple:
  """The model keys (num_layers, d_model, heads, mlp_hidden) whose non-embedding count is nearest
  ``target``, as sorted (key, value) pairs. Models with an MLP keep ``layers`` layers and heads of
  ``head`` channels and take the d_model whose SwiGLU, solved to the target, is nearest MLP_RATIO x
  d; the official Mamba-2 LM (no MLP: two blocks per MLP-model layer, as mamba_ssm's 130M has 24
  layers where a transformer has 12) picks among 2 x ``layers`` +- 1 layers and d_model in steps of
  32 the count nearest the target."""
  if arm_keys.get("mamba2_variant") == "official":
    best = None
    for n in (2 * layers - 1, 2 * layers, 2 * layers + 1):
      for d in range(32, 4097, 32):
        keys = dict(num_layers=max(n, 1), d_model=d, num_heads=2 * d // 64, head_dim=64)
        count = non_embedding_of(arm_keys, **keys)
        err = abs(count / target - 1)
        if best is None or err < best[0]:
          best = (err, keys)
        if count > target:
          break
    return tuple(sorted(best[1].items()))
  best = None
  for d in range(head, 4097, head):
    keys = dict(num_layers=layers, d_model=d, num_heads=d // head, head_dim=head)
    beside = non_embedding_of(arm_keys, mlp_hidden=0, **keys)
    per_unit = non_embedding_of(arm_keys, mlp_hidden=8, **keys) - beside  # 8 units of every MLP
    hidden = round((target - beside) / per_unit) * 8
    if hidden <= 0:
      break
    err = abs(hidden / d - MLP_RATIO)
    if best is None or err < best[0]:
      best = (err, dict(keys, mlp_hidden=hidden))
  return tuple(sorted(best[1].items()))


def sized_model(vocab_size: int, tiny: bool, keys: dict):
  """A model of the sized studies (copying, the map): width and depth in ``keys`` (an arm's
  mixer keys and a solved shape), no MLP matching; fp32 for the CPU-sized ``tiny``, else bf16
  compute over fp32 parameters."""
  return model_config(
    "tiny",
    vocab_size=vocab_size,
    chunk_size=16 if tiny else 64,
    dtype="float32" if tiny else "bfloat16",
    param_dtype="float32",
    match_params=False,
    **keys,
  )


def sized_run(c, tiny: bool, lr: float, eval_examples: int):
  """The sized studies' evaluation, logging and optimiser settings (CPU-sized when ``tiny``)."""
  c.data.eval_batch_size = 8 if tiny else 64
  c.data.num_eval_examples = eval_examples
  c.data.read_threads = 2 if tiny else 4
  c.train.log_every = 10 if tiny else 100
  c.train.eval_batches = 1 if tiny else 4
  c.optim.learning_rate = lr
  c.optim.weight_decay = 0.1
  c.checkpoint.keep = 1
  c.logging.plot = c.logging.tensorboard = False
