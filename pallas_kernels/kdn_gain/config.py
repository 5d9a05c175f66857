"""Block-size configuration for the Moebius gain kernels: `diag_gain(config=...)` and the other
gain ops; None means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GainConfig:
  # Each value's measurement: docs/decisions.md.
  max_chunk: int = 128  # caps the caller's chunk_size (C_g)
  # Triton warps per program: rows are [1, K], one warp covers them
  num_warps: int = 1
  # Triton software-pipelining stages of the token loops, forward (reduce, replay) and backward
  # kernels apart: more stages tied in the forward and lost in fwd+bwd.
  num_stages_fwd: int = 1
  num_stages_bwd: int = 1

  def __post_init__(self):
    if not (
      self.num_warps > 0 and self.num_warps & (self.num_warps - 1) == 0 and self.num_warps <= 32
    ):
      raise ValueError(
        f"GainConfig.num_warps must be a power of two in [1, 32] (Triton warps), "
        f"got {self.num_warps}"
      )
    for name in ("max_chunk", "num_stages_fwd", "num_stages_bwd"):
      if getattr(self, name) < 1:
        raise ValueError(f"GainConfig.{name} must be >= 1, got {getattr(self, name)}")
