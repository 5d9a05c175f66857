"""Block-size configuration for the chunked delta-rule kernels: `delta_rule(config=...)`; None
means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig:
  # Defaults: the fastest configuration that passed the H200 correctness check with segments in
  # fp32 and bf16 (measurements in docs/decisions.md). Sessions 4-5,
  # diag KDN fwd+bwd, B=4 H=16 K=V=128 bf16 T=4096: 17.2 ms (old defaults) -> 12.8 (wy, split
  # kernels, block_v=64, num_warps_recur=4, num_stages=2, each faster on its own) -> 8.0 (chunk 16,
  # bf16 storage of A/P/Wt/W, block_v_parallel=128, 4-warp intra backward) -> 7.3 (bf16 states,
  # session 6; sub_block at chunk 64/32 was 16.1/11.2 ms there: its intra kernels cost 6.3 ms
  # forward against 1.6). Chunk 16 first failed
  # the fp32 reset check: the two-carry serial backward (backward.py, _SEG_NOTE), now one carry.
  # min_chunk keeps a floor for compiled runs should a GPU need one.
  max_chunk: int = 16  # caps the caller's chunk_size (C_m)
  min_chunk: int = 16  # floor of the chunk in compiled runs (interpret mode: 16)
  # The row block of the forward's pair and WY kernels (16 when 0). (Until session 39 it also
  # split the intra backward of longer chunks into row blocks; the token-parallel intra
  # backward takes any chunk.)
  sub_block: int = 0
  # Saved chunk-start states and state gradients ([B, H, T/C, K, V], the largest arrays) in bf16
  # under bf16-operand dots: half their bytes (fla stores its chunk states in the data dtype
  # too). H200 T=4096 diag KDN fwd+bwd 8.09 -> 7.26 ms; with packed documents the recurrent
  # backward 9.1 -> 5.1 ms; the GPU check (bf16 <= 4.1e-3) passes. fp32 data keeps fp32 states.
  bf16_states: bool = True
  # The forward by stage (issue 18; __init__'s docstring): a pair kernel for L, P and Wt (by
  # default token-parallel: pair_diag below; else per (chunk, 16-row block),
  # intra._pair_rows_kernel: the diagonal 16 x 16 tile by a column loop
  # whose columns are stored straight to L and P, earlier blocks (chunks > 16) by one dot with a
  # masked row store), a WY kernel for
  # A = (I + L)^-1 (fp32 forward substitution on the 16 x 16 diagonal blocks, merged in closed
  # form for longer chunks), W = A Kbar and U = A V' (wy.py), a serial pass whose chain is
  # Delta = U - W S_0 and S <- exp(g_last) S + Wt^T Delta (Delta stored in the operand dtype),
  # and the output kernel on a (V block, chunk, batch head) grid. The backward consumes the same
  # residuals (A, P, Wt, W, states), its serial kernel keeping only the dS chain.
  # Session 29 (H200, diag KDN T=4096): op forward 2.95 -> 2.70 ms against the single intra
  # kernel it replaced (intra stage 1.53 -> 1.10); the chunk-64 forward (3.40 ms) still loses.
  # Removed in session 31 as slower in every measured cell: that single intra kernel (with its
  # `blocked` sub-tiles and `inverse` options), the 3-dot serial chain (`wy=False`) and the
  # serial kernel that formed O itself (`split_output=False`) (docs/decisions.md).
  num_warps_pairs: int = 4  # Triton warps, the pair kernel
  # The pair products' kernel (intra.py): 'token_loop' (token-parallel, fla's structure: one
  # program per (token row, pair_heads heads), the row's columns j <= r one per step; chunks of
  # one row block only, longer chunks take 'columns') or 'columns' (one program per (chunk, row
  # block), the diagonal S x S tile by an S-step column loop). Session 35, H200 diag KDN T=4096:
  # pair stage 0.61 ms with token_loop / pair_heads=4 against 0.77-0.96 for 'columns'; op
  # forward 1.97 ms, fwd+bwd 5.28 (T=16384: 6.88 / 19.85). Lost and removed there: a vectorised
  # token-parallel kernel (0.84-1.16 ms) and [S, S, K-slice] pair tensors (1.41-2.9 ms).
  pair_diag: str = "token_loop"
  pair_heads: int = 4  # heads per token-parallel program (token_loop, the intra backward)
  # A call that is not differentiated (inference, evaluation) runs the forward at this chunk
  # (0: like a differentiated one); differentiated calls keep the config above, whose residuals
  # the backward reads (__init__.forward_only).
  forward_only_chunk: int = 0
  block_v: int = 64  # value-columns per program in the recurrent (state-passing) kernels
  # value-columns per program in the parallel output and backward-partials kernels (fewer V
  # blocks: fewer per-V-block partial-gradient bytes for the intra backward to read and sum)
  block_v_parallel: int = 128
  # Triton warps, the WY kernel (H200 T=4096: 0.40 ms with 4, 0.45 with 8). Session 44, H200
  # diag KDN forward T=16384, one process: 5.12 ms with 4, 4.81-4.94 with 2, 4.65 with 1 (its
  # 16 x 16 substitution's row reductions stay inside one warp); fwd+bwd 15.48 -> 15.18.
  num_warps_intra: int = 1
  # Triton warps, the token-parallel intra backward (intra_bwd_tokens.py; session 38, H200 diag
  # KDN fwd+bwd T=16384: 18.48 ms against 19.08 for the per-chunk kernel fused with the
  # partials, removed in session 39 (backward.py); pair_heads=8: 19.35, 2 warps: 19.40)
  num_warps_intra_bwd: int = 4
  # Triton warps, the backward-partials kernel. 8 won before tiles.by_reset (with segments
  # 17.4 ms at 4 against 4.3 at 8, H200 T=4096); session 39, H200 diag KDN fwd+bwd, one process
  # per length: T=16384 17.81 -> 16.83 ms at 4 (partials 5.00 -> 3.78), with documents 19.62 ->
  # 18.34; T=4096 4.96 -> 4.59, with documents 5.31 -> 5.07.
  num_warps_parallel: int = 4
  # Triton warps, the output kernel: its program is one [C, K] x [K, BV] dot (H200, diag KDN
  # T=4096, session 30: output stage 0.83 ms with 8 warps, 0.53 with 4; op forward 2.57 -> 2.36
  # ms. Looping over 2-8 consecutive chunks per program, tried in the same sweep, gained nothing
  # beyond that and was dropped: docs/decisions.md). Session 44, diag KDN fwd+bwd
  # T=16384 (with num_warps_intra=1): 15.18 ms with 4, 14.92-14.94 with 2, 14.90 with 1.
  num_warps_output: int = 2
  num_warps_recur: int = 4  # Triton warps, recurrent kernels (serial over chunks)
  # Three passes cut from the forward's memory traffic, the default since session 48 (H200, one
  # process, diag KDN forward T=16384, the three against none: 3.94 ms against 4.70 / 4.82 (the
  # default timed before and after the others); the first two alone 4.30; T=4096 1.31 against
  # 1.27 / 1.36, a tie; fwd+bwd T=16384 14.04 against 14.35 / 14.40; GPU check at K=128 and 16,
  # segments included, within the bounds (fp32 <= 5.5e-7, bf16 <= 4.5e-3);
  # docs/decisions.md):
  # The decay cumsum g formed by the token-parallel pair kernel (which then reads log_alpha and
  # writes g) instead of by its own kernel before it (chunk_cumsum.py): one pass over
  # [B, T, H, K] fp32 less (the cumsum's read of log_alpha and its launch; H200 T=16384 stage
  # split: cumsum 0.36 ms) for a loop of loads and adds per row in the pair kernel (Wt's decay
  # to the chunk's last token): its row loads per program go from about 19 (w_j and g_j for the
  # 8.5 columns j <= r on average, g_r, g_last) to about 24.5 (w_j and log_alpha_j for those
  # columns, log_alpha_j for the 7.5 after r). Applies where the pair kernel is token-parallel
  # (pair_diag 'token_loop', chunk 16), to every forward (differentiated or not). Session 45
  # trial; session 46, H100, diag KDN forward: T=16384 4.94 -> 4.61 ms (pair kernel with the
  # cumsum 1.56 ms against 1.48 + 0.42 for the two kernels), T=4096 ~1.40 -> 1.35.
  cumsum_in_pairs: bool = True
  # The token-parallel pair kernel, which holds q, k and g for its row, also writes the decayed
  # dot operands Kbar = k exp(g) and Qbar = scale q exp(g) in the dots' operand dtype (bf16 for
  # 16-bit data), which the WY kernel reads in place of k and g and the output (fused into the
  # state pass, or its own kernel) in place of q and g: the same values those kernels formed and
  # rounded for their dots (bit-identical outputs in interpret mode). With cumsum_in_pairs, a
  # call that is not differentiated then writes no fp32 g at all, only g at each chunk's last
  # row for the state pass. Bytes (diag KDN forward, B=4 H=16 K=128 T=16384, bf16): the pair
  # kernel writes Kbar and Qbar (2 + 2 bytes per element) in place of g (4), and the WY and
  # state/output kernels each read 2 bytes per element in place of 6 (1.0 GB less; the fused
  # step 459 -> 345 instructions, its 16 exps gone: docs/decisions.md). In
  # training the pair kernel writes g as well (the backward reads it). Chunks of one row block
  # (the token-parallel pair kernel) only; elsewhere ignored. Session 48: forward T=16384
  # 4.30 -> 3.94 ms on top of the other two.
  decayed_operands: bool = True
  # A computed write direction (the diagonal KDN gain kappa, op and layer) stored in bf16 when
  # the delta rule's dots take bf16 operands (16-bit q, k, v; write_dtype):
  # the gain kernel writes half the bytes, and the token-parallel pair kernel, whose column
  # loads bound it (fla's equivalent kernel, which reads bf16 k and fp32 g per column, ran at
  # 82% of L1 throughput in session 35's profile), reads 6 bytes per column element instead of
  # 8. kappa then also enters L (and so A's fp32 inverse) rounded to bf16, where P, Wt and W
  # round it anyway, and its gradient comes back in bf16 like dq, dk and dv. Session 45 trial;
  # session 46, H100, diag KDN forward: T=16384 4.94 -> 4.78 ms, T=4096 ~1.40 -> 1.32.
  bf16_write: bool = True
  # A write given as a per-token scalar beta ([B, T, H], write = beta k: DeltaNet's, KDA's and
  # the isotropic KDN's) formed inside the pair kernels and the intra backward, beta applied
  # after their reductions over K (and beta's gradient <dw, k> summed there), instead of an XLA
  # multiply writing a [B, T, H, K] fp32 write (0.54 GB at B=4 T=16384 H=16 K=128, read back
  # by the pair kernel; its gradient another pass). Session 45, exact in interpret mode (tests);
  # not yet timed (no device that session): gpu_measurements.sh forward times both at 16k.
  scalar_write: bool = True
  # Triton software-pipelining stages of the kernels' loops. Session 39, H200 fwd+bwd, one
  # process per line, 2 -> 3: diag KDN T=16384 16.83 -> 16.18 ms (GPU check passed at 3), with
  # documents 18.17 -> 17.92, iso 15.48 -> 15.32; T=4096 4.57 -> 4.51.
  num_stages: int = 3
  # The decay cumsum kernels' row loops (chunk_cumsum.py) with the loads of this many rows issued
  # together, the next block's ahead (pallas_kernels/token_loop.py; 1: a plain loop, a memory
  # round trip per row). Session 43, H200 diag KDN T=16384 stage split, one process: cumsum
  # 0.41 -> 0.35 ms at 8 (0.37 at 16), reverse cumsum 1.02 -> 0.82 (0.88); the op's fwd+bwd
  # 15.24 / 15.27 / 15.23 ms (its run-to-run spread). The same values (same sums, same order).
  cumsum_block: int = 8

  def __post_init__(self):
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    for name in ("max_chunk", "min_chunk", "block_v", "block_v_parallel"):
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
    if self.sub_block and (not pow2(self.sub_block) or self.sub_block < 16):
      raise ValueError(
        f"DeltaRuleConfig.sub_block must be 0 or a power of two >= 16, got {self.sub_block}"
      )
    if self.forward_only_chunk and not pow2(self.forward_only_chunk):
      raise ValueError(
        "DeltaRuleConfig.forward_only_chunk must be 0 or a power of two, got "
        f"{self.forward_only_chunk}"
      )
    if self.pair_diag not in ("columns", "token_loop"):
      raise ValueError(
        f"DeltaRuleConfig.pair_diag must be 'columns' or 'token_loop', got {self.pair_diag!r}"
      )
    if not pow2(self.pair_heads):
      raise ValueError(f"DeltaRuleConfig.pair_heads must be a power of two, got {self.pair_heads}")
