"""The context-parallel ops (context_parallel.py) for whole arrays under `jit`, and the layers'
choice of op: `context_sharded(op)` runs one in `shard_map` with T split over a mesh axis;
`sequence_sharding(mesh)` is the setting under which `op(name)`, what a layer calls, returns
that form instead of the plain op.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from kdn_jax.ops import delta_rule as delta_rule_ops
from kdn_jax.ops import dispatch
from kdn_jax.ops import kdn as kdn_ops
from kdn_jax.ops.context_parallel import OPS


def context_sharded(op, mesh=None, *, axis_name="context", batch_axes=None):
  """The context-parallel `op` as a function of whole arrays, for use under
  `jit`: it runs `shard_map` over `mesh` with every [B, T, ...] argument and
  segment_ids split along T over `axis_name` (and B over `batch_axes`), the
  initial state split over `batch_axes` only.

  op: a name in OPS ('diag_kdn', 'kda', ...). mesh: a Mesh, or None for the
  mesh set with `jax.set_mesh`. The returned function has the plain op's
  signature (positional sequence arrays, keyword arguments); T must be a
  multiple of the axis size.
  """
  if op not in OPS:
    raise ValueError(f"context_sharded: op={op!r} is not one of {', '.join(OPS)}")
  cp_op = OPS[op]
  name = f"context_sharded({op!r})"

  def call(*arrays, initial_state=None, segment_ids=None, info_scale=None, impl="auto", **static):
    m = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if m is None or axis_name not in m.axis_names:
      raise ValueError(
        f"{name}: axis_name={axis_name!r} is not an axis of "
        f"the mesh (axes {getattr(m, 'axis_names', ())})"
      )
    n = m.shape[axis_name]
    t = arrays[0].shape[1]
    if t % n:
      raise ValueError(
        f"{name}: the sequence length T={t} is not a multiple "
        f"of the mesh axis {axis_name!r} of size {n}; pad T"
      )
    resolved = dispatch.resolve_impl(name, impl)
    seq = P(batch_axes, axis_name)
    per_seq = P(batch_axes)
    traced_mu = info_scale is not None and not isinstance(info_scale, (int, float))
    kw_specs = {"initial_state": per_seq, "segment_ids": seq}
    kw = {"initial_state": initial_state, "segment_ids": segment_ids}
    if traced_mu:
      kw["info_scale"], kw_specs["info_scale"] = jnp.asarray(info_scale), P()
    elif info_scale is not None:
      static["info_scale"] = info_scale
    kw = {k: x for k, x in kw.items() if x is not None}
    kw_specs = {k: kw_specs[k] for k in kw}

    def body(arrays, kw):
      return cp_op(*arrays, axis_name=axis_name, impl=resolved, **kw, **static)

    # Pallas outputs carry no varying mesh axes (WORKSPACE.md).
    return jax.shard_map(
      body,
      mesh=m,
      in_specs=((seq,) * len(arrays), kw_specs),
      out_specs=(seq, per_seq),
      check_vma=resolved != "pallas",
    )(arrays, kw)

  return call


# The setting `sequence_sharding` installs while a model is traced: (mesh,
# axis_name, batch_axes) or None.
_SETTING = contextvars.ContextVar("kdn_jax_context_parallel", default=None)


@contextlib.contextmanager
def sequence_sharding(mesh, axis_name="context", batch_axes=None):
  """While active, `op(name)` returns the context-parallel op over
  `mesh[axis_name]` (when that axis has more than one device).

  Layers pick their op while tracing, and the setting is not part of JAX's
  trace cache key: trace a function inside it (call a jitted function only
  inside it, or give it a fresh function), or a cached trace from outside is
  reused.
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"sequence_sharding: axis_name={axis_name!r} is not an "
      f"axis of the mesh (axes {mesh.axis_names})"
    )
  token = _SETTING.set((mesh, axis_name, batch_axes))
  try:
    yield
  finally:
    _SETTING.reset(token)


def active_setting():
  """(mesh, axis_name, batch_axes) of the active `sequence_sharding` when its
  axis has more than one device, else None."""
  setting = _SETTING.get()
  if setting is None or setting[0].shape[setting[1]] == 1:
    return None
  return setting


def _plain_op(name):
  """The unsplit op, from the module that defines it (not the package, which imports this one)."""
  return getattr(kdn_ops if name in ("diag_kdn", "iso_kdn") else delta_rule_ops, name)


def op(name):
  """The op a layer should call: `kdn_jax.ops.<name>`, or under an active
  `sequence_sharding` with more than one device on its axis, that op with
  T split over the axis (same signature). A T the axis does not divide
  falls back to the plain op (XLA then gathers the sequence), with a
  warning."""
  if name not in OPS:
    raise ValueError(f"context_parallel.op: name={name!r} is not one of {', '.join(OPS)}")
  plain = _plain_op(name)
  setting = active_setting()
  if setting is None:
    return plain
  mesh, axis_name, batch_axes = setting
  sharded = context_sharded(name, mesh, axis_name=axis_name, batch_axes=batch_axes)

  def call(*arrays, **kwargs):
    n = mesh.shape[axis_name]
    if arrays[0].shape[1] % n:
      logging.log_first_n(
        logging.WARNING,
        "context_parallel: %s with T=%d, not a multiple of "
        "the %r axis (%d devices): running unsplit",
        4,
        name,
        arrays[0].shape[1],
        axis_name,
        n,
      )
      return plain(*arrays, **kwargs)
    return sharded(*arrays, **kwargs)

  return call


__all__ = ["active_setting", "context_sharded", "op", "sequence_sharding"]
