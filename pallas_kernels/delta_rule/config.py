"""Block-size configuration for the chunked delta-rule kernels: `delta_rule(config=...)`; None
means the tuned entry for the device (pallas_kernels/tuned.py). Each default is the fastest
value that passed the GPU correctness check with segments in fp32 and bf16; the measurements
behind every value, and the options removed, are in docs/decisions.md."""

import dataclasses

# The chunk of the Triton (GPU and generic interpret-mode) kernels: every longer chunk measured
# lost on the GPU, and their pair kernel covers one 16-row block per chunk (docs/decisions.md).
GPU_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig:
  # Caps the caller's chunk_size on the Mosaic-TPU kernels (tpu_forward.py), which take any
  # power of two and have no TPU timing yet (experiments/benchmarks/tpu_check.py sweeps it). The
  # Triton kernels run GPU_CHUNK and refuse another value.
  max_chunk: int = 16
  # Saved chunk-start states and state gradients ([B, H, T/C, K, V], the largest arrays) in bf16
  # under bf16-operand dots: half their bytes, within the bf16 bounds; fp32 data keeps fp32.
  bf16_states: bool = True
  num_warps_pairs: int = 4  # Triton warps, the token-parallel pair kernel (intra.py)
  pair_heads: int = 4  # heads per token-parallel program (the pair kernel, the intra backward)
  block_v: int = 64  # value-columns per program in the recurrent (state-passing) kernels
  # value-columns per program in the parallel output and backward-partials kernels (fewer V
  # blocks: fewer per-V-block partial-gradient bytes for the intra backward to read and sum)
  block_v_parallel: int = 128
  # Key columns the intra-chunk kernels hold at a time (the pair kernel's and the intra
  # backward's row loops, the WY kernel's Kbar products): a wider K runs in key tiles of
  # block_k, each holding the registers of K = block_k. K in (block_k, 256] also switches the
  # [K, BV] kernels to the wide V blocks.
  block_k: int = 128
  # Value-columns per program of the recurrent and parallel kernels when K > block_k (in place of
  # block_v and block_v_parallel): a [K, BV] state tile then holds as many elements as at
  # K = block_k (K = V = 256 in 128-column parallel blocks needs 293 KB of shared memory, more
  # than an H100's 227 KB: docs/decisions.md). Not timed on a GPU yet (gpu_measurements.sh wide).
  wide_block_v: int = 32
  wide_block_v_parallel: int = 64
  # Triton warps, the WY kernel: its 16 x 16 substitution's row reductions stay inside one warp.
  num_warps_intra: int = 1
  num_warps_intra_bwd: int = 4  # Triton warps, the token-parallel intra backward
  num_warps_parallel: int = 4  # Triton warps, the backward-partials kernel
  # Triton warps, the output kernel: one [C, K] x [K, BV] dot per program.
  num_warps_output: int = 2
  num_warps_recur: int = 4  # Triton warps, recurrent kernels (serial over chunks)
  num_stages: int = 3  # Triton software-pipelining stages of the kernels' loops
  # The reverse decay cumsum's row loops (chunk_cumsum.py) issue the loads of this many rows
  # together, the next block's ahead (pallas_kernels/token_loop.py; 1: a plain loop, a memory
  # round trip per row). The same sums in the same order at any value.
  cumsum_block: int = 8

  def __post_init__(self):
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    for name in (
      "max_chunk",
      "block_v",
      "block_v_parallel",
      "wide_block_v",
      "wide_block_v_parallel",
    ):
      if not pow2(getattr(self, name)):
        raise ValueError(
          f"DeltaRuleConfig.{name} must be a power of two, got {getattr(self, name)}"
        )
    for f in dataclasses.fields(self):
      if f.name.startswith("num_warps") and not (
        pow2(getattr(self, f.name)) and getattr(self, f.name) <= 32
      ):
        raise ValueError(
          f"DeltaRuleConfig.{f.name} must be a power of two in [1, 32] (Triton "
          f"warps), got {getattr(self, f.name)}"
        )
    if self.cumsum_block < 1:
      raise ValueError(f"DeltaRuleConfig.cumsum_block must be >= 1, got {self.cumsum_block}")
    if not (pow2(self.block_k) and self.block_k >= 16):
      raise ValueError(f"DeltaRuleConfig.block_k must be a power of two >= 16, got {self.block_k}")
    if not pow2(self.pair_heads):
      raise ValueError(f"DeltaRuleConfig.pair_heads must be a power of two, got {self.pair_heads}")
