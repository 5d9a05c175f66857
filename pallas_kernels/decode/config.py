"""Launch configuration of the fused decode step: `delta_rule_step(config=...)`, `kdn_step`; None
means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """block_v: value columns of the state per program (a [K, block_v] block, read and written once);
  the grid is (B, H, V / block_v). Default 8: one step moves only the state, so the kernel is
  bound by how many loads are in flight, which wants many small programs at every batch: at B = 1
  (H = 16, V = 128) block_v = 8 gives 256 programs for an H100's / H200's 132 SMs where 32 gave
  64, and 8 fp32 columns are one 32-byte DRAM sector, the smallest block that moves no unused
  bytes. num_warps 1: a [128, 8] block is 32 values per thread of one warp, and the two
  reductions over K stay inside the warp (no shared-memory round trip). Chosen from that count,
  not yet timed: experiments/benchmarks/decode.py --block_v / --num_warps sweeps them against
  fla's fused_recurrent_kda on the GPU."""

  block_v: int = 8
  num_warps: int = 1
  num_stages: int = 1

  def __post_init__(self):
    if self.block_v < 8 or self.block_v & (self.block_v - 1):
      raise ValueError(
        f"DecodeConfig.block_v must be a power of two >= 8 (one 32-byte sector of fp32), "
        f"got {self.block_v}"
      )
    if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
      raise ValueError(f"DecodeConfig.num_warps must be a power of two >= 1, got {self.num_warps}")
