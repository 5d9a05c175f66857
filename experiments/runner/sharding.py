"""Device mesh and shardings: parameters from their logical axis annotations, batches over data."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import schema

AXES = schema.MESH_AXES
BATCH_AXES = ("data", "fsdp")  # FSDP is data parallel too: the batch is split over both.
CONTEXT_AXIS = (
  "context"  # splits T of every batch array (context parallelism, kdn_jax.ops.context_parallel)
)
_META_KEYS = ("out_sharding", "sharding_names", "sharding")

_initialized = False


def maybe_initialize_distributed(config):
  """Calls ``jax.distributed.initialize()`` once when ``config.mesh.distributed`` is set."""
  global _initialized
  if config.mesh.distributed and not _initialized:
    jax.distributed.initialize()
    _initialized = True


def make_mesh(shape: tuple[int, ...], devices) -> Mesh:
  """``devices`` laid out as the (data, fsdp, tensor, context) ``shape`` that schema.check_mesh
  resolved for them."""
  devices = list(devices)
  try:
    dev = mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # pylint: disable=broad-except
    dev = np.asarray(devices).reshape(shape)
  return Mesh(dev, AXES)


def logical_names(variable) -> tuple | None:
  """Logical axis names stored on an NNX variable (or its abstract copy), if any."""
  meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
  for key in _META_KEYS:
    names = meta.get(key)
    if names is not None and not isinstance(names, (NamedSharding, P)):
      return tuple(names)
    if isinstance(names, P):
      return tuple(names)
  return None


def spec_for(shape, names, rules: dict, mesh: Mesh) -> P:
  """Maps logical names to mesh axes; a dim that does not divide its axis size, or a mesh axis already used
  by an earlier dim, is replicated."""
  if names is None:
    return P()
  if len(names) != len(shape):
    logging.warning("sharding names %s do not match shape %s; replicating", names, shape)
    return P()
  used, out = set(), []
  for dim, name in zip(shape, names):
    axis = rules.get(name, "") if name is not None else ""
    if axis and axis not in used and mesh.shape[axis] > 1 and dim % mesh.shape[axis] == 0:
      out.append(axis)
      used.add(axis)
    else:
      out.append(None)
  return P(*out)


def state_shardings(abstract_state, config, mesh: Mesh):
  """NamedShardings for an (abstract) nnx.State whose leaves are Variables with logical metadata."""
  rules = dict(config.mesh.rules)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def one(var):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    return NamedSharding(mesh, spec_for(value.shape, logical_names(var), rules, mesh))

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def sequence_batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """[B, T, ...] batch arrays: B over the batch axes, T over the context axis."""
  if ndim < 2:
    return batch_sharding(mesh, ndim)
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS, *([None] * (ndim - 2))))


def context_parallel(mesh: Mesh):
  """The context under which a model is traced: its recurrent ops split T over the context axis when
  it has more than one device (a no-op context otherwise)."""
  from kdn_jax.ops import context_sharding  # pylint: disable=g-import-not-at-top

  return context_sharding.sequence_sharding(mesh, CONTEXT_AXIS, BATCH_AXES)


def traced_context_parallel(mesh: Mesh, fn):
  """fn (a jitted step) called, and so traced, under ``context_parallel(mesh)``."""

  def call(*args, **kwargs):
    with context_parallel(mesh):
      return fn(*args, **kwargs)

  call.jitted = fn  # for .lower() (inside context_parallel(mesh))
  return call


def leading_batch_shardings(tree, mesh: Mesh):
  """Shards every array leaf of ``tree`` (e.g. recurrent states) along its leading batch axis."""
  return jax.tree.map(
    lambda x: batch_sharding(mesh, np.ndim(x)) if np.ndim(x) else replicated(mesh), tree
  )


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
  """Assembles per-process numpy batches ([B, T] arrays) into globally sharded jax arrays."""
  return {
    k: jax.make_array_from_process_local_data(sequence_batch_sharding(mesh, v.ndim), v)
    for k, v in local_batch.items()
  }
