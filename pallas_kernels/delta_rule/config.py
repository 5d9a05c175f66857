"""Block-size configuration for the chunked delta-rule kernels.

`DEFAULT` is what `delta_rule` uses; `set_default(**overrides)` swaps it (benchmarks / tuning).
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig:
  # Defaults = the fastest of the H200 sweeps (diag KDN fwd+bwd, B=4 H=16 K=V=128 bf16 T=4096;
  # docs/benchmark_mixers.md): each of wy, split_backward, split_output, block_v=64,
  # num_warps_recur=4, num_stages=2 beat the 17.2 ms baseline on its own (13.5 ms for wy alone).
  # Third sweep (same protocol, docs/benchmark_mixers.md): max_chunk 16 with the 'blocks' inverse on
  # 8-token blocks, 9.8 ms against 11.1 ms for chunk 32 with 'rows'.
  max_chunk: int = 16        # caps the caller's chunk_size (C_m)
  block: int = 8             # sub-block for the intra-chunk decay products and the inverse
  # Sub-blocked intra pair products: off-diagonal block x block tiles as matmuls around a
  # reference point, the diagonal tiles by a `block`-step column loop (else a C-step loop).
  blocked: bool = False
  # Pair products of the intra kernels as [C, C, kblock] tiles summed over K in K/kblock steps
  # (0: the C-step column loop). Validated in interpret mode; not yet timed on a GPU.
  kblock: int = 0
  # The intra column loops run over K in k_split slices one after another (exact), so only
  # [C, K / k_split] tiles are live: fewer registers per program, more programs per SM.
  k_split: int = 1
  # What precision='fast' (bf16/fp16 data) means for the dots: 'bf16' (operands rounded to bf16,
  # fp32 accumulation: twice the TF32 tensor-core rate; flash-linear-attention's choice; H200 diag
  # KDN fwd+bwd T=4096: 14.9 ms against 16.5 ms with 'tf32') or 'tf32' (fp32 operands).
  fast_dots: str = "bf16"
  # Serial kernel keeps only the state chain and a parallel kernel forms the outputs from the
  # saved chunk-start states (flash-linear-attention's split).
  split_output: bool = True
  # The reverse serial kernel keeps only the state-gradient chain and saves each chunk's dS; a
  # parallel kernel forms dV and the partial gradients (the backward twin of split_output).
  split_backward: bool = True
  # (I + L)^-1 in the intra kernel: 'rows' (forward substitution, reductions across rows),
  # 'rows_t' (the same on the transpose: reductions within rows), 'blocks' (block substitution
  # with `block`-sized diagonal blocks, matmuls), 'doubling' (product of 2 log2(C) - 2 matmuls).
  inverse: str = "blocks"
  # Compact WY: the intra kernel also emits W = A Kbar, so each chunk's dependent dot chain in
  # the serial kernels is 2 dots (W S_0, then the state update) instead of 3.
  wy: bool = True
  block_v: int = 64          # value-columns per program in the recurrent (state-passing) kernels
  num_warps_intra: int = 8   # Triton warps, intra-chunk kernels (parallel over chunks)
  num_warps_recur: int = 4   # Triton warps, recurrent kernels (serial over chunks)
  num_stages: int = 2         # Triton software-pipelining stages of the kernels' loops

  def __post_init__(self):
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    for name in ("max_chunk", "block", "block_v"):
      if not pow2(getattr(self, name)):
        raise ValueError(f"DeltaRuleConfig.{name} must be a power of two, got {getattr(self, name)}")
    if not pow2(self.k_split):
      raise ValueError(f"DeltaRuleConfig.k_split must be a power of two, got {self.k_split}")
    if self.kblock and not pow2(self.kblock):
      raise ValueError(f"DeltaRuleConfig.kblock must be 0 or a power of two, got {self.kblock}")
    if self.inverse not in ("rows", "rows_t", "blocks", "doubling"):
      raise ValueError("DeltaRuleConfig.inverse must be 'rows', 'rows_t', 'blocks' or 'doubling', "
                       f"got {self.inverse!r}")
    if self.fast_dots not in ("tf32", "bf16"):
      raise ValueError(f"DeltaRuleConfig.fast_dots must be 'tf32' or 'bf16', got {self.fast_dots!r}")


DEFAULT = DeltaRuleConfig()


def set_default(**overrides):
  global DEFAULT
  DEFAULT = dataclasses.replace(DEFAULT, **overrides)
  return DEFAULT
