"""Block sizes of the gated RMSNorm kernels: `gated_rms_norm(config=...)`; None means the tuned
entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class NormConfig:
  # tokens per program (one head's [block_t, V] tile; V = 128 at the paper's shape)
  block_t: int = 64
  num_warps: int = 4
  num_stages: int = 1
