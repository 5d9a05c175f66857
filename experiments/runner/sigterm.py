"""SIGTERM seen at once, even while the main thread sits in a long XLA call.

Python runs a signal handler only when the main thread is back in the interpreter, so a SIGTERM that
arrives during the first step's compile (minutes for a large model on a CPU) waits for the compile, the
step and the save that follows. Python's C-level handler also writes the signal's number to the wakeup
fd (``signal.set_wakeup_fd``) the moment the signal lands, from whichever thread receives it; a helper
thread reading that fd sees the SIGTERM then. Before the run's first step has been dispatched there is
nothing to save (the state is the restored checkpoint, or the seed's initialisation, which a rerun
rebuilds exactly), so the process exits right away with 128 + SIGTERM; after it, the Python handler's
flag stops the loop at the next step with a checkpoint, as before.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable

EXIT_CODE = 128 + signal.SIGTERM


class SigtermWatch:
  """Context manager: installs ``handler`` for SIGTERM and, while ``started()`` is False, exits the
  process at once on SIGTERM with one line (``exit_now``: os._exit, replaceable in tests)."""

  def __init__(
    self,
    handler: Callable,
    started: Callable[[], bool],
    message: str,
    exit_now: Callable[[int], None] = os._exit,
  ):
    self.handler, self.started, self.message, self.exit_now = handler, started, message, exit_now

  def __enter__(self):
    self._read, write = os.pipe()
    self._stop_read, self._stop_write = os.pipe()
    os.set_blocking(write, False)
    self._write = write
    self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self._old_handler = signal.signal(signal.SIGTERM, self.handler)
    self._thread = threading.Thread(target=self._watch, name="sigterm-watch", daemon=True)
    self._thread.start()
    return self

  def _watch(self):
    while True:
      ready, _, _ = select.select([self._read, self._stop_read], [], [])
      if self._stop_read in ready:
        return
      got = os.read(self._read, 512)
      if signal.SIGTERM in got and not self.started():
        print(self.message, file=sys.stderr, flush=True)
        self.exit_now(EXIT_CODE)

  def __exit__(self, *exc):
    signal.signal(signal.SIGTERM, self._old_handler)
    signal.set_wakeup_fd(self._old_fd)
    os.write(self._stop_write, b"x")
    self._thread.join()
    for fd in (self._read, self._write, self._stop_read, self._stop_write):
      os.close(fd)
    return False
