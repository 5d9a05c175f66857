"""Launch configuration of the fused decode step: `delta_rule_step(config=...)`, `kdn_step`; None
means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  # value columns of the state per program: a program holds a [K, block_v] fp32 block (16 KB at
  # K = 128, block_v = 32), and B * H * V / block_v programs spread a small batch over the SMs
  # (B = 1, H = 16, V = 128: 64 programs). Untimed: the GPU benchmark
  # (experiments/benchmarks/decode.py) is the place to choose it.
  block_v: int = 32
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if self.block_v < 16 or self.block_v & (self.block_v - 1):
      raise ValueError(f"DecodeConfig.block_v must be a power of two >= 16, got {self.block_v}")
