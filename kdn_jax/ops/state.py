"""Recurrent state of the KDN family."""

from typing import NamedTuple

import jax


class KDNState(NamedTuple):
  """State of a KDN layer (a pytree).

  memory:   [B, H, K, V] associative memory S (float32; float64 under x64).
  variance: [B, H, K] per-channel variance (diag KDN) or [B, H] per-head
            variance (iso KDN).
  """

  memory: jax.Array
  variance: jax.Array
