"""The length-generalisation map's cells (experiments/studies/lengen_map/study.py): small LMs pretrained
from the zero state at T on the code corpus (``prepare --recipe=linux_c``), sized by their
non-embedding parameter count.

    python -m experiments.train --config=configs/lengen_map.py:2m,mamba2_long,t64 \\
        --config.data.corpus_dir=/tmp/kdn_code --workdir=/tmp/map/m2l_2m_t64

Arg ``<size>,<arm>,t<T>[,<initial_state>]``. Arms (ARMS): ``mamba2`` (mamba_ssm's Mamba-2 block and
LM, mamba2_variant='official', dt in [1e-3, 1e-1]), ``mamba2_long`` (the same with dt in [1e-4,
1e-2]: time constants 10x longer at init), ``gla``, ``kdn_diag``. Sizes (SIZES: the target
non-embedding parameter count): ``500k``, ``2m``, ``8m``; ``tiny`` (a few thousand parameters, for
CPU tests). T: 64 or 256 (``tiny``: any).

Widths are solved for the count (`shape`): the MLP mixers (gla, kdn_diag) keep LAYERS[size] layers,
heads of 64 channels and the d_model whose SwiGLU, solved to the target, is nearest the usual 8/3 x
d; the official Mamba-2 LM (no MLP, two blocks per MLP-model layer, as mamba_ssm's 130M has 24 layers
where a transformer has 12) picks among 2 x LAYERS[size] +- 1 layers and d_model in steps of 32 the
count nearest the target. `tests/studies/test_lengen_map.py` holds every count within 10% of its
target. The vocabulary is the corpus's (the model's ``vocab_size`` is set from its manifest by the
study); tied embedding.

Training: batch of TOKENS_PER_STEP[size] tokens (rows = tokens / T), peak LR[size], 5% warm-up then
cosine to 0.1x over the whole budget, AdamW (0.9, 0.95), weight decay 0.1 (none on A_log / dt_bias /
D / norms), clip 1.0, bf16 compute with fp32 parameters (``tiny``: fp32). The study sets the steps and
kept checkpoints from its tokens-per-parameter budget. A strategy other than ``zero`` is the
post-training's initial state (the study sets ``init_from``, steps and rate).
"""

from __future__ import annotations

import functools

from configs import common

LONG_DT = {"dt_min": 1e-4, "dt_max": 1e-2}
OFFICIAL = {"mixer": "mamba2", "mamba2_variant": "official"}
ARMS = {
  "mamba2": {**OFFICIAL, "dt_min": 1e-3, "dt_max": 1e-1},
  "mamba2_long": {**OFFICIAL, **LONG_DT},
  "gla": {"mixer": "gla"},
  "kdn_diag": {"mixer": "kdn_diag"},
}
SIZES = {"tiny": 16_000, "500k": 500_000, "2m": 2_000_000, "8m": 8_000_000}
LAYERS = {"tiny": 1, "500k": 2, "2m": 4, "8m": 6}
LENGTHS = (64, 256)
TOKENS_PER_STEP = {"tiny": 128, "500k": 32_768, "2m": 65_536, "8m": 131_072}
LR = {"tiny": 1e-2, "500k": 3e-3, "2m": 3e-3, "8m": 2e-3}
HEAD = 64  # channels per head of the MLP mixers (the official block's headdim is its own, 64)
TINY_HEAD = 16
WARMUP_FRACTION = 0.05
TOLERANCE = 0.10  # |count / target - 1| every solved shape keeps


def _count(arm: str, **keys) -> int:
  return common.non_embedding_of(ARMS[arm], **keys)


@functools.lru_cache(maxsize=64)
def shape(arm: str, size: str) -> tuple[tuple[str, object], ...]:
  """The model keys (num_layers, d_model, heads, mlp_hidden) whose non-embedding count is nearest
  SIZES[size] for ``arm`` (module docstring; ``common.solve_shape``), as sorted (key, value) pairs."""
  head = TINY_HEAD if size == "tiny" else HEAD
  return common.solve_shape(ARMS[arm], SIZES[size], LAYERS[size], head)


def non_embedding(arm: str, size: str) -> int:
  return _count(arm, **dict(shape(arm, size)))


def state_elements(arm: str, size: str) -> int:
  """Recurrent state entries per layer (per sequence): heads x key x value channels."""
  keys = dict(shape(arm, size))
  if ARMS[arm].get("mamba2_variant") == "official":
    m = common.mamba2_official
    return m.EXPAND * keys["d_model"] // m.HEADDIM * m.D_STATE * m.HEADDIM
  return keys["num_heads"] * keys["head_dim"] ** 2


def parse(arg: str) -> tuple[str, str, int, str]:
  """'<size>,<arm>,t<T>[,<initial_state>]' -> (size, arm, T, initial_state)."""
  parts = [p for p in (arg or "").split(",") if p]
  where = f"configs/lengen_map.py:{arg}"
  if len(parts) not in (3, 4):
    raise common.ConfigError(f"{where}: expected <size>,<arm>,t<T>[,<initial_state>]")
  size, arm, t, *rest = parts
  if size not in SIZES:
    raise common.ConfigError(f"{where}: unknown size {size!r}; expected one of {list(SIZES)}")
  if arm not in ARMS:
    raise common.ConfigError(f"{where}: unknown arm {arm!r}; expected one of {list(ARMS)}")
  if not (t.startswith("t") and t[1:].isdigit() and int(t[1:]) > 0):
    raise common.ConfigError(f"{where}: expected the training length as t<T>, got {t!r}")
  strategy = rest[0] if rest else "zero"
  if strategy not in common.INITIAL_STATES:
    raise common.ConfigError(
      f"{where}: unknown initial state {strategy!r}; expected one of {common.INITIAL_STATES}"
    )
  return size, arm, int(t[1:]), strategy


def get_config(arg: str = "500k,mamba2,t64"):
  size, arm, seq_len, strategy = parse(arg)
  tiny = size == "tiny"
  c = common.base_config()
  c.data.kind = "token_file"
  c.data.corpus_dir = "/tmp/kdn_code"
  c.data.seq_len = seq_len
  c.data.global_batch_size = max(1, TOKENS_PER_STEP[size] // seq_len)
  c.train.initial_state = strategy
  # the vocabulary: prepare --recipe=linux_c's default; the study sets the corpus's
  c.model = common.sized_model(8192, tiny, {**ARMS[arm], **dict(shape(arm, size))})
  common.sized_run(c, tiny, LR[size], eval_examples=16 if tiny else 512)
  return c
