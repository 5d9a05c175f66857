"""Grouped value heads (GVA): fewer query/key heads than value heads.

flash-linear-attention's convention: q and k have H_k heads; v, the output, the decay, the write
(beta), the KDN noise inputs (omega, r, info_scale) and the state have H_v = G * H_k heads, and
value head j reads q/k head j // G (each q/k head serves G consecutive value heads). The ops
repeat q and k to H_v heads, so autodiff sums their gradients back over each group.
"""

import jax.numpy as jnp


def to_value_heads(op, q, k, v, axis=2):
  """(q, k) repeated along `axis` (the heads) to v's head count.

  Unchanged when the counts agree, or when the arrays are malformed in another way (the op's
  shape checks name that); a ValueError when v's heads are not a multiple of q's.
  """
  if min(jnp.ndim(x) for x in (q, k, v)) <= axis or jnp.shape(q) != jnp.shape(k):
    return q, k
  hk, hv = q.shape[axis], v.shape[axis]
  if hk == hv:
    return q, k
  if hv < hk or hv % hk:
    raise ValueError(
      f"{op}: v has {hv} heads and q, k have {hk}: grouped value heads need "
      f"the value heads to be a multiple of the query/key heads"
    )
  group = hv // hk
  return jnp.repeat(q, group, axis=axis), jnp.repeat(k, group, axis=axis)
