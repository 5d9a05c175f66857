"""Block sizes of the causal depthwise conv1d kernels.

`DEFAULT` is what `causal_conv1d` uses; `set_default(**overrides)` swaps it.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  # rows (tokens) per program; a program covers one head's K channels ([1, K] rows, one warp)
  block_t: int = 64
  num_warps: int = 1
  num_stages: int = 1


DEFAULT = ConvConfig()


def set_default(**overrides):
  global DEFAULT
  DEFAULT = dataclasses.replace(DEFAULT, **overrides)
  return DEFAULT
