"""Block-size configuration for the chunked delta-rule kernels.

`DEFAULT` is what `delta_rule` uses; `set_default(**overrides)` swaps it (benchmarks / tuning).
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig:
  # Defaults = the fastest of the H200 sweep (diag KDN fwd+bwd, B=4 H=16 K=V=128 bf16 T=4096):
  # 32/8/8 warps/block_v 32: 19.7 ms; 32/4/4/64: 27.5 ms; 64/8/8/64: 25.5 ms.
  max_chunk: int = 32        # caps the caller's chunk_size (C_m)
  block: int = 16            # sub-block for the intra-chunk decay products and the inverse
  # Sub-blocked intra kernels (matmuls around a reference point + blocked inverse). Validated on
  # CPU only: its first H200 compile ran > 3 minutes and was cut off, so it is off by default.
  blocked: bool = False
  # Pair products of the intra kernels as [C, C, kblock] tiles summed over K in K/kblock steps
  # (0: the C-step column loop). Validated in interpret mode; not yet timed on a GPU.
  kblock: int = 0
  # What precision='fast' (bf16/fp16 data) means for the dots: 'bf16' (operands rounded to bf16,
  # fp32 accumulation: twice the TF32 tensor-core rate; flash-linear-attention's choice; H200 diag
  # KDN fwd+bwd T=4096: 14.9 ms against 16.5 ms with 'tf32') or 'tf32' (fp32 operands).
  fast_dots: str = "bf16"
  # Serial kernel keeps only the state chain (3 dots per chunk) and a parallel kernel forms the
  # outputs from the saved chunk-start states (flash-linear-attention's split). Validated in
  # interpret mode; not yet timed on a GPU.
  split_output: bool = False
  # The reverse serial kernel keeps only the state-gradient chain and saves each chunk's dS; a
  # parallel kernel forms dV and the partial gradients (the backward twin of split_output).
  split_backward: bool = False
  # Compact WY: the intra kernel also emits W = A Kbar, so each chunk's dependent dot chain in
  # the serial kernels is 2 dots (W S_0, then the state update) instead of 3.
  wy: bool = False
  block_v: int = 32          # value-columns per program in the recurrent (state-passing) kernels
  num_warps_intra: int = 8   # Triton warps, intra-chunk kernels (parallel over chunks)
  num_warps_recur: int = 8   # Triton warps, recurrent kernels (serial over chunks)
  num_stages: int = 1

  def __post_init__(self):
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    for name in ("max_chunk", "block", "block_v"):
      if not pow2(getattr(self, name)):
        raise ValueError(f"DeltaRuleConfig.{name} must be a power of two, got {getattr(self, name)}")
    if self.kblock and not pow2(self.kblock):
      raise ValueError(f"DeltaRuleConfig.kblock must be 0 or a power of two, got {self.kblock}")
    if self.fast_dots not in ("tf32", "bf16"):
      raise ValueError(f"DeltaRuleConfig.fast_dots must be 'tf32' or 'bf16', got {self.fast_dots!r}")


DEFAULT = DeltaRuleConfig()


def set_default(**overrides):
  global DEFAULT
  DEFAULT = dataclasses.replace(DEFAULT, **overrides)
  return DEFAULT
