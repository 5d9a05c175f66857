"""The kernels under a sharded jit: every device runs them on its own batch / head shard.

XLA cannot partition a pallas_call: given batch-sharded operands it gathers them and runs the
whole kernel on every device (on an 8-device CPU mesh the compiled gradient held 213
all-gathers; two H200s, data parallel, trained the 125M LM at only 1.51x the tokens/s of one).
The kernels are independent across batch entries and heads, so `per_shard` wraps a kernel body
in custom_partitioning: batch and head dims keep the operands' sharding, every other dim is
replicated, and the body runs on the local shards. Operands sharded along T, K or V, or with a
batch / head count the mesh axes do not divide, are gathered (with a warning). On one device,
inside a fully manual shard_map, and under vmap (custom_partitioning has no batching rule) the
plain body runs. Not on TPU: custom_partitioning does not compile there (jax issue #38196).
"""

from __future__ import annotations

import logging
import math

import jax
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["per_shard"]


def _as_tuple(axes):
  return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _dim_axes(shapes, dims, which, mesh, taken=()):
  """Mesh axes of the first operand sharded along its `which` dim (0: batch, 1: head), kept only
  if they divide that dim and avoid `taken`; () when none."""
  for s, d in zip(shapes, dims):
    pos = d[which]
    sharding = getattr(s, "sharding", None)
    if pos is None or not isinstance(sharding, NamedSharding):
      continue
    spec = tuple(sharding.spec) + (None,) * (len(s.shape) - len(sharding.spec))
    axes = _as_tuple(spec[pos])
    if not axes:
      continue
    size = math.prod(mesh.shape[a] for a in axes)
    if s.shape[pos] % size or set(axes) & set(taken):
      return ()
    return axes
  return ()


def _shardings(mesh, shapes, dims, batch_axes, head_axes):
  out = []
  for s, (b, h) in zip(shapes, dims):
    spec = [None] * len(s.shape)
    if b is not None and batch_axes:
      spec[b] = batch_axes
    if h is not None and head_axes:
      spec[h] = head_axes
    out.append(NamedSharding(mesh, P(*spec)))
  return tuple(out)


def _warn_gathered(name, arg_shapes, kept):
  """Warns (at compile time) when an operand's sharding is more than the kernels keep."""
  for i, (s, want) in enumerate(zip(arg_shapes, kept)):
    have = getattr(s, "sharding", None)
    if not isinstance(have, NamedSharding):
      continue
    used = {a for d in have.spec for a in _as_tuple(d)}
    if used - {a for d in want.spec for a in _as_tuple(d)}:
      logging.warning(
        "pallas_kernels: %s operand %d %s arrives sharded as %s; the kernel keeps only its "
        "batch / head sharding (%s, divisible sizes), so it is gathered to that first.",
        name,
        i,
        tuple(s.shape),
        have.spec,
        want.spec,
      )


def _rule(in_ndims, in_dims, out_ndims, out_dims):
  """Shardy rule: factor b = batch, h = heads, every other dim its own replicated factor."""
  local = []

  def value(ndim, dims, tag):
    names = []
    for j in range(ndim):
      if j == dims[0]:
        names.append("b")
      elif j == dims[1]:
        names.append("h")
      else:
        names.append(f"{tag}d{j}")
        local.append(names[-1])
    return " ".join(names)

  lhs = ", ".join(value(n, d, f"i{i}") for i, (n, d) in enumerate(zip(in_ndims, in_dims)))
  rhs = ", ".join(value(n, d, f"o{i}") for i, (n, d) in enumerate(zip(out_ndims, out_dims)))
  return f"{lhs} -> {rhs}", tuple(local)


def per_shard(fn, in_dims, out_dims, name):
  """`fn(*args) -> tuple` run per (batch, head) shard under a sharded jit (`name`: for warnings).

  in_dims: for each argument, (batch_dim, head_dim) with None where the array has no such dim;
  arguments may be None (absent optional arrays). out_dims: for each result, (batch_dim,
  head_dim, ndim), or None for a result `fn` returns as None (given up front, so the body is
  traced once). `fn` must be independent across batch entries and heads (results with a batch
  or head dim depend only on the same entries of the arguments)."""

  def wrapped(*args):
    if jax.default_backend() == "tpu":
      return fn(*args)
    present = [i for i, a in enumerate(args) if a is not None]
    dims = [in_dims[i] for i in present]

    arrays = [args[i] for i in present]
    out_present = [j for j, d in enumerate(out_dims) if d is not None]
    odims = [out_dims[j][:2] for j in out_present]

    def body(*arrays):
      filled = [None] * len(args)
      for i, a in zip(present, arrays):
        filled[i] = a
      out = fn(*filled)
      return tuple(out[j] for j in out_present)

    def axes(mesh, arg_shapes):
      batch = _dim_axes(arg_shapes, dims, 0, mesh)
      return batch, _dim_axes(arg_shapes, dims, 1, mesh, taken=batch)

    def infer(mesh, arg_shapes, result_shape):
      out_shapes = jax.tree.leaves(result_shape)
      return _shardings(mesh, out_shapes, odims, *axes(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
      batch, heads = axes(mesh, arg_shapes)
      out_shapes = jax.tree.leaves(result_shape)
      arg_shardings = _shardings(mesh, arg_shapes, dims, batch, heads)
      _warn_gathered(name, arg_shapes, arg_shardings)
      return (mesh, body, _shardings(mesh, out_shapes, odims, batch, heads), arg_shardings)

    rule, local = _rule(
      [a.ndim for a in arrays], dims, [out_dims[j][2] for j in out_present], odims
    )
    cp = custom_partitioning(body)
    cp.def_partition(
      partition,
      infer_sharding_from_operands=infer,
      sharding_rule=rule,
      need_replication_factors=local,
    )

    @custom_batching.custom_vmap
    def call(*arrays):
      return cp(*arrays)

    @call.def_vmap
    def _vmapped(axis_size, in_batched, *arrays):
      del axis_size
      out = jax.vmap(body, in_axes=tuple(0 if b else None for b in in_batched))(*arrays)
      return out, tuple(True for _ in out)

    out = iter(call(*arrays))
    return tuple(None if d is None else next(out) for d in out_dims)

  return wrapped
