"""Block sizes of the gated RMSNorm kernels. `DEFAULT` is what `gated_rms_norm` uses."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class NormConfig:
  # tokens per program (one head's [block_t, V] tile; V = 128 at the paper's shape)
  block_t: int = 64
  num_warps: int = 4
  num_stages: int = 1


DEFAULT = NormConfig()


def set_default(**overrides):
  global DEFAULT
  DEFAULT = dataclasses.replace(DEFAULT, **overrides)
  return DEFAULT
