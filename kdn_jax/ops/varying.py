"""shard_map support: scan carries must vary over the same manual mesh axes
as the data they are combined with."""

import jax


def _varying_axes(x):
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # older / newer spelling


def like_varying(x, ref):
  """x cast to vary over every manual axis that `ref` varies over."""
  missing = tuple(sorted(_varying_axes(ref) - _varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def all_varying(*xs):
  """Each of xs cast to vary over every manual axis any of them varies over (a custom VJP's
  cotangents must vary as its inputs do: the casts' transposes sum the unvarying ones)."""
  axes = frozenset().union(*(_varying_axes(x) for x in xs))
  return tuple(
    jax.lax.pcast(x, tuple(sorted(axes - _varying_axes(x))), to="varying")
    if axes - _varying_axes(x)
    else x
    for x in xs
  )
