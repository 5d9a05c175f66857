"""Several processes stop at the same step: jax.distributed's preemption service catches SIGTERM on any
host and agrees on a step for all of them (a save is collective; a host that stops alone leaves the
others waiting in the next step's all-reduce)."""

from __future__ import annotations

import logging

import jax


def service():
  """jax.distributed's preemption sync manager when several processes run with it, else None."""
  if jax.process_count() == 1:
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return getattr(distributed.global_state, "preemption_sync_manager", None)


def reached(step: int) -> bool:
  """True on every process at the same step once any of them got SIGTERM (called every step)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  if multihost_utils.reached_preemption_sync_point(step):
    logging.warning(
      "preemption (SIGTERM on some process) agreed at step %d: saving a checkpoint and exiting",
      step,
    )
    return True
  return False
