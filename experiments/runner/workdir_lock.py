"""One run per workdir: ``<workdir>/run.lock`` names the process that trains in it.

Two runs in one workdir interleave their checkpoints (one deletes the other's in-flight save) and
metric rows. The lock file holds the owner's pid, host and process start time; a second run that
finds it exits at start naming the owner. A lock whose owner is gone (killed: nothing removed the
file) is stale and is taken over: on the same host when its pid is not running (or runs another
program, started at another time). A lock from another host cannot be checked from here; it is
honoured, and the message says which file to delete if that run is known to be dead.
"""

from __future__ import annotations

import json
import os
import socket
import time

from experiments import schema

LOCK_NAME = "run.lock"
_HELD = {}  # lock path -> number of holders in this process (several Trainers of one workdir in tests)


class WorkdirInUseError(schema.ConfigError):
  """Another live run holds the workdir (a config error: the command names a busy --workdir)."""


def _start_time(pid: int):
  """The process's start time in clock ticks since boot (Linux), or None where unknown."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      fields = f.read().rpartition(")")[2].split()
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited
  except (OSError, IndexError, ValueError):
    return None


def _alive(pid: int, start) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    pass
  now = _start_time(pid)
  if os.path.exists("/proc/self/stat") and now is None:
    return False  # gone, or a zombie
  return (
    start is None or now is None or now == start
  )  # the same pid reused by another process: gone


def _owner(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _me() -> dict:
  return {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "start": _start_time(os.getpid()),
    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
  }


def _is_me(owner) -> bool:
  me = _me()
  return bool(owner) and owner.get("pid") == me["pid"] and owner.get("host") == me["host"]


def _stale(owner) -> bool:
  return owner.get("host") == socket.gethostname() and not _alive(
    int(owner.get("pid", -1)), owner.get("start")
  )


def acquire(workdir: str) -> str:
  """Takes the workdir's lock (creating the workdir) and returns its path; raises WorkdirInUseError with
  one line when a live run holds it."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
  for _ in range(50):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      owner = _owner(path)
      if owner is None:  # being written this instant, or torn by a crash mid-write
        if time.time() - _mtime(path) > 10:
          _remove_if_unchanged(path, None)
        time.sleep(0.05)
        continue
      if _is_me(owner):
        _HELD[path] = _HELD.get(path, 0) + 1
        return path
      if _stale(owner):
        _remove_if_unchanged(path, owner)
        continue
      raise WorkdirInUseError(
        f"{workdir} is in use by another run (pid {owner.get('pid')} on {owner.get('host')}, since "
        f"{owner.get('since')}); wait for it to end or use another --workdir (if that run is dead, delete "
        f"{path})"
      ) from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(_me(), f)
    _HELD[path] = 1
    return path
  raise WorkdirInUseError(
    f"{workdir}: could not take {path} (it keeps changing); is another run starting?"
  )


def release(path: str | None):
  """Gives the lock back (the last holder in this process removes the file, if it is still ours)."""
  if path is None or path not in _HELD:
    return
  _HELD[path] -= 1
  if _HELD[path] > 0:
    return
  del _HELD[path]
  if _is_me(_owner(path)):
    try:
      os.remove(path)
    except FileNotFoundError:
      pass


def _mtime(path: str) -> float:
  try:
    return os.path.getmtime(path)
  except OSError:
    return time.time()


def _remove_if_unchanged(path: str, owner):
  """Removes a stale lock unless another run replaced it meanwhile. Two runs breaking the same stale
  lock at once: each removes only the file it judged stale, and only one O_EXCL create then wins."""
  breaker = f"{path}.break"
  try:
    fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    if time.time() - _mtime(breaker) > 30:  # its maker died mid-break
      os.remove(breaker)
    return
  try:
    os.close(fd)
    if _owner(path) == owner:
      os.remove(path)
  except FileNotFoundError:
    pass
  finally:
    os.remove(breaker)
