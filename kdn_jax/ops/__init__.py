"""kdn_jax.ops: the KDN family and its delta-rule relatives in JAX.

Layout [B, T, H, K] (flash-linear-attention's). Every op takes
`impl` in {'auto', 'reference', 'chunked', 'pallas'}; 'reference' is the
token-by-token ground truth, 'chunked' the chunkwise XLA form, 'pallas' the
kernels in `pallas_kernels`; 'auto' picks Pallas on GPU, chunked on TPU, and on
CPU the token loop while its per-token states are small, else chunked
(dispatch.CPU_REFERENCE_MAX_STATE_BYTES).
`context_parallel` holds the same ops with T split over a mesh axis; `context_sharding` runs
them under jit and picks them for the layers.
`checked=True` checks the values' domains (r > 0, log_alpha <= 0, ...) and
raises InvalidValueError; `checked(fn)` makes that work under jit.
"""

from kdn_jax.ops import context_parallel, context_sharding
from kdn_jax.ops.context_sharding import context_sharded, sequence_sharding
from kdn_jax.ops.delta_rule import (
  delta_net,
  delta_net_step,
  delta_rule,
  delta_rule_step,
  gated_delta_rule,
  gated_delta_rule_step,
  gdn2,
  gdn2_step,
  gla,
  gla_step,
  kda,
  kda_step,
)
from kdn_jax.ops.kdn import diag_kdn, diag_kdn_step, iso_kdn, iso_kdn_step
from kdn_jax.ops.mobius import mobius_scan
from kdn_jax.ops.state import KDNState
from kdn_jax.ops.validation import IMPLS, InvalidValueError, checked
from kdn_jax.ops.variance import diag_variance_scan, iso_variance_scan

__all__ = [
  "IMPLS",
  "InvalidValueError",
  "KDNState",
  "checked",
  "context_parallel",
  "context_sharding",
  "context_sharded",
  "delta_net",
  "delta_net_step",
  "delta_rule",
  "delta_rule_step",
  "diag_kdn",
  "diag_kdn_step",
  "diag_variance_scan",
  "gated_delta_rule",
  "gated_delta_rule_step",
  "gdn2",
  "gdn2_step",
  "gla",
  "gla_step",
  "iso_kdn",
  "iso_kdn_step",
  "iso_variance_scan",
  "kda",
  "kda_step",
  "mobius_scan",
  "sequence_sharding",
]
