"""Block sizes of the causal depthwise conv1d kernels: `causal_conv1d(config=...)`; None means
the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  # rows (tokens) per program; a program covers one head's K channels ([1, K] rows, one warp)
  block_t: int = 64
  num_warps: int = 1
  num_stages: int = 1
  # rows whose loads (x, dy, positions) are issued together in the row loops, the next block's
  # ahead (pallas_kernels/token_loop.py; 1: a plain loop): faster layers at 8, the same
  # arithmetic (docs/decisions.md, `load_block`).
  load_block: int = 8

  def __post_init__(self):
    if self.load_block < 1:
      raise ValueError(f"ConvConfig.load_block must be >= 1, got {self.load_block}")
