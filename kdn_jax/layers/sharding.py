"""Logical axis names used on every parameter, and a default logical -> mesh axis mapping.

Parameters carry ``out_sharding`` metadata with these logical names. Map them to mesh axes with::

    with nnx.logical_axis_rules(logical_axis_rules()):
        pspecs = nnx.get_partition_spec(nnx.state(model, nnx.Param))

Names not present in the rules pass through unchanged, so the rules must cover every name.
"""

from __future__ import annotations

LOGICAL_AXES = ("vocab", "embed", "mlp", "heads", "kv", "lowrank", "conv", None)


def logical_axis_rules(fsdp: str | None = "fsdp", tensor: str | None = "tensor") -> tuple:
  """FSDP over the model dim, tensor parallelism over heads / MLP hidden / vocab."""
  return (
    ("vocab", tensor),
    ("embed", fsdp),
    ("mlp", tensor),
    ("heads", tensor),
    ("kv", None),
    ("lowrank", None),
    ("conv", None),
  )
