"""Block-size configuration for the Moebius gain kernels: `diag_gain(config=...)` and the other
gain ops; None means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GainConfig:
  # caps the caller's chunk_size (C_g); H200 diag gain fwd, T=4096 (raw-input kernels): 0.46 ms
  # at 128 (1 warp); at 4 warps 0.48 at 64, 0.63 at 256
  max_chunk: int = 128
  # Triton warps per program; H200 diag gain fwd T=4096 (kernels reading the raw inputs): 0.46 ms
  # with 1 warp, 0.50 with 2 (rows are [1, K]: one warp covers them)
  num_warps: int = 1
  # Triton software-pipelining stages of the token loops, forward (reduce, replay) and backward
  # kernels apart. Session 38, H200 diag gain T=16384, one process: forward 1.29 ms at 1 stage,
  # 1.16 at 2 or 3; fwd+bwd with every kernel at 2: 3.48 against 3.45 (the backward lost what the
  # forward gained). Session 44, the forward at 1 / 2 / 3 stages in two processes: 1.21 / 1.21
  # / 1.15 and 1.32 / 1.34 / 1.33 ms, a tie; 1 stays.
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
