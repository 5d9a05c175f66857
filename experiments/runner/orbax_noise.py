"""orbax's noise on failure, counted or held back so that a failure reads as one line.

A failed restore leaves orbax's in-flight reads to print "Event loop is closed" or unfinished
coroutines, about a hundred per damaged checkpoint; a failed save logs an ERROR with a traceback
from several threads, and asyncio a "Task exception was never retrieved" per sibling write. The
hooks and log filters here count or hold those back while experiments/runner/checkpoint.py raises
one error naming the checkpoint; everything else passes through.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time


def is_abandoned_read(unraisable) -> bool:
  """A read callback scheduled on orbax's closed loop, or one of orbax's read coroutines closed
  unfinished by the garbage collector."""
  if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
    unraisable.exc_value
  ):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


@contextlib.contextmanager
def abandoned_reads_dropped(settle_s: float = 0.3, max_wait_s: float = 3.0, keep=None):
  """Counts, instead of printing, the abandoned reads of a failed orbax restore.

  orbax reads a checkpoint's arrays concurrently on an asyncio loop. When one read of a damaged
  checkpoint fails, the restore raises and closes the loop while the other reads are in flight. Each
  of those then printed "Exception ignored ... Event loop is closed" (from tensorstore's threads) or
  an unfinished-coroutine traceback (from the garbage collector): about a hundred per damaged
  checkpoint. Inside the block they are counted; every other unraisable exception goes to the
  previous hook. The caller appends to the yielded list when its restore failed and handles the
  error inside the block (the error's traceback keeps the coroutines alive until it is dropped).
  After a failure the block's exit waits until no abandoned read has arrived for `settle_s` (at
  most `max_wait_s`) and logs the count in one line; a restore that succeeds is not delayed. With
  `keep` (a list) a failed block does not wait: it leaves its hook installed and appends (hook,
  previous hook, counts) to it, for release_hooks to take out later (Checkpointer.close): stragglers can come
  after any quiet window on a loaded machine (a CI run got 21 past the 0.3 s one). The hook is
  process-wide: one restore at a time, as the runner does."""
  dropped, failed = [], []
  previous = sys.unraisablehook

  def hook(unraisable):
    if is_abandoned_read(unraisable):
      dropped.append(time.monotonic())
    else:
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield failed
  finally:
    try:
      if failed and keep is None:  # (a kept hook keeps counting; close waits for stragglers)
        start = time.monotonic()
        gc.collect()
        while time.monotonic() - start < max_wait_s:
          time.sleep(settle_s / 3)
          gc.collect()
          if time.monotonic() - max(dropped, default=start) >= settle_s:
            break
    finally:
      if failed and keep is not None:
        keep.append((hook, previous, dropped))
      else:
        sys.unraisablehook = previous
        _log_dropped(dropped, failed)


def _log_dropped(dropped, failed):
  if dropped:
    # (a restore's hook also counts stragglers of an earlier failed one whose hook is kept)
    logging.info(
      "checkpoint: dropped %d abandoned reads during a %s restore",
      len(dropped),
      "failed" if failed else "successful",
    )


def release_hooks(kept, settle_s: float = 1.0, max_wait_s: float = 5.0):
  """Takes out the hooks that failed restores left installed (newest first), once no abandoned
  read has arrived for `settle_s` (at most `max_wait_s`; a close right after a failed restore,
  e.g. when no checkpoint was readable, waits for the stragglers), the garbage collector's share
  collected."""
  if not kept:
    return
  start = time.monotonic()
  last = lambda: max((max(d, default=start) for _, _, d in kept), default=start)
  gc.collect()
  while time.monotonic() - start < max_wait_s and time.monotonic() - last() < settle_s:
    time.sleep(settle_s / 5)
    gc.collect()
  while kept:
    hook, previous, dropped = kept.pop()
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    _log_dropped(dropped, True)


class _DropMissingMetadata(logging.Filter):
  def filter(self, record):
    msg = record.getMessage()  # (a missing metadata file is reported by the caller, in one line)
    return "Metadata file does not exist" not in msg and "Failed to get item metadata" not in msg


@contextlib.contextmanager
def quiet_missing_metadata():
  log, filt = logging.getLogger("absl"), _DropMissingMetadata()
  log.addFilter(filt)
  try:
    yield
  finally:
    log.removeFilter(filt)


def describe(e: BaseException) -> str:
  """'Type: first line' of an error (orbax's run to a hundred lines)."""
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def quietly(read, keep=None):
  """(read(), None), or (None, the error's one line) when it raised: the abandoned reads of a failed
  orbax read are counted instead of printed (abandoned_reads_dropped; ``keep`` as there)."""
  with abandoned_reads_dropped(keep=keep) as failed:
    try:
      return read(), None
    except Exception as e:  # pylint: disable=broad-except  (any failure: described in one line)
      failed.append(True)
      return None, describe(e)


class HeldBackSaveErrors(logging.Filter):
  """Holds back orbax's ERROR logs (each with a traceback, from several threads per failed save) while a
  Checkpointer is open: the failure surfaces as one CheckpointSaveError instead. Kept for the message."""

  def __init__(self):
    super().__init__()
    self.held = []

  def filter(self, record):
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in (record.pathname or ""):
      self.held.append(record.getMessage())
      return False
    return True


class _UnretrievedSaveTasks(logging.Filter):
  """Drops asyncio's 'Task exception was never retrieved' for orbax's write tasks: when one write of a
  save fails (a full disk) the save raises with the first error, and its sibling tasks, failed the same
  way, are logged with a traceback each whenever the garbage collector takes them, often after the run
  has printed its one-line error. Installed once per process: the save's failure is always raised."""

  count = 0

  def filter(self, record):
    msg = record.getMessage()
    if "exception was never retrieved" in msg and f"{os.sep}orbax{os.sep}" in msg:
      _UnretrievedSaveTasks.count += 1
      return False
    return True


def drop_unretrieved_save_tasks():
  log = logging.getLogger("asyncio")
  if not any(isinstance(f, _UnretrievedSaveTasks) for f in log.filters):
    log.addFilter(_UnretrievedSaveTasks())


def abandoned_writes_hook(previous, dropped):
  """sys.unraisablehook that counts, instead of printing, what tensorstore's threads leave when a failed
  save's asyncio loop has closed under them (as abandoned_reads_dropped does for a failed restore), and
  passes everything else on."""

  def hook(unraisable):
    if is_abandoned_read(unraisable):
      dropped.append(time.monotonic())
    else:
      previous(unraisable)

  return hook
