"""At most a few training steps in flight: the host waits for step n - MAX_IN_FLIGHT before it
dispatches step n.

JAX dispatches a step and returns at once, so without a bound the loop runs ahead of the device until
the next log line syncs it (hundreds of steps); a SIGTERM, an error or the final save then waits for
every queued step (minutes for a large model on a CPU). Two steps in flight keep the device fed (the
host prepares step n while step n - 1 runs) and bound that wait by two steps.
"""

from __future__ import annotations

import collections

import jax

MAX_IN_FLIGHT = 2


class DispatchWindow:
  def __init__(self, size: int = MAX_IN_FLIGHT):
    self.size, self._queue = int(size), collections.deque()

  def add(self, step_output):
    """Records a dispatched step's output (any array it returns) and waits for the oldest beyond the
    window."""
    self._queue.append(step_output)
    while len(self._queue) > self.size:
      jax.block_until_ready(self._queue.popleft())
