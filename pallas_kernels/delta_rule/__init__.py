"""Chunked asymmetric delta rule (per-channel or scalar decay) as Pallas kernels + custom VJP.

Per (batch, head) and chunk of C tokens with chunk-local log-decay cumsum g (restarted at segment
starts), state S_0 at the chunk start (S_init for rows whose segment starts inside the chunk):
    L_rj = sum_c k_rc w_jc exp(g_rc - g_jc)   (r > j, same segment)        A = (I + L)^-1
    P_rj = scale sum_c q_rc w_jc exp(g_rc - g_jc)   (r >= j, same segment)
    Kbar = k * exp(g), Qbar = scale q * exp(g), Wt_j = w_j exp(g_last - g_j) (same segment as last)
    U = V - Kbar S_0,  Delta = A U,  O = Qbar S_0 + P Delta,  S_C = exp(g_last) S_0 + Wt^T Delta.
Decay ratios are only ever formed as exp(min(g_r - g_j, 0)) of log DIFFERENCES, never exp(-g).

The op: chunk.py (delta_rule and its custom VJPs), chunk_fwd.py (forward_stages: the forward's
stages per (batch, head) shard), chunk_bwd.py (backward_stages), inputs.py (stage_inputs: the
arguments checked and padded, segment_arrays, chunk_length, write_dtype). One module per stage
(options in config.DeltaRuleConfig), imported only from those:
  intra         g, L, P, Wt, Kbar and Qbar (the token-parallel pair kernel, from log_alpha; the
                later stages read Kbar and Qbar in place of k, q and g), then wy: A,
                W = A Kbar, U = A V', parallel over chunks
  state_pass    the serial chunk loop: S_final, chunk-start states, Delta = U - W S_0 (with
                calls that store no states and have no segments also O, in the same loop)
  output        O = Qbar S_0 + P Delta, parallel over chunks
  backward      the reverse dS chain, dV and the partial gradients, then intra_bwd_tokens
  intra_bwd_tokens  the intra backward, token-parallel
  chunk_cumsum  the transpose of g's chunk-local cumsum (the backward's)
  tiles         helpers the stage kernels share (no kernels)
  tpu_forward / tpu_backward   the Mosaic-TPU kernels (BlockSpec tiles; docs/tpu.md)
The Triton kernels run chunks of config.GPU_CHUNK (16) tokens; the TPU kernels any power of two
up to DeltaRuleConfig.max_chunk.
"""

from pallas_kernels.delta_rule.chunk import delta_rule
from pallas_kernels.delta_rule.chunk_bwd import backward_stages
from pallas_kernels.delta_rule.chunk_fwd import forward_stages
from pallas_kernels.delta_rule.inputs import chunk_length, segment_arrays, stage_inputs, write_dtype

__all__ = [
  "delta_rule",
  "stage_inputs",
  "forward_stages",
  "backward_stages",
  "chunk_length",
  "segment_arrays",
  "write_dtype",
]
