"""Whether jit's tracing context grew while the first step was traced or compiled (every jit cache
entry made before then is missed once more)."""

from __future__ import annotations

import sys


def tracing_context():
  """(jit tracing-context values: count, their names or None, the imported module names)."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top

  try:
    names = tuple(jax_config.trace_context_names())
  except Exception:  # pylint: disable=broad-except  (older jaxlibs cannot name them)
    names = None
  return len(jax_config.trace_context()), names, frozenset(sys.modules)


def context_growth(before, after):
  """A warning when jit's tracing context grew between two `tracing_context()` snapshots (else
  None). A value registered while the first step was traced or compiled (seen on jax 0.11.2 with
  CUDA; not on CPU) changes the key of every jit cache entry made before it, so the train step is
  traced and compiled again at the next step (docs/decisions.md)."""
  if after[0] == before[0]:
    return None
  names = None if before[1] is None or after[1] is None else sorted(set(after[1]) - set(before[1]))
  mods = sorted(m for m in after[2] - before[2] if not m.startswith("experiments"))
  return (
    f"jit tracing context grew during the first step ({before[0]} -> {after[0]} values; "
    f"new: {names if names is not None else 'unnamed'}; modules imported meanwhile: "
    f"{mods[:20]}{' ...' if len(mods) > 20 else ''}): the train step will be traced and "
    "compiled again at the next step"
  )
