"""The one launcher of a study's processes: several at a time under a deadline, with progress and
ETA. The (arm x stage) studies' parallel arms (study_driver.run_parallel), the MQAR Zoology sweeps
and the noise factorial's trainings and evaluations all run through ``run_jobs``.

Each job is one subprocess (its output appended to ``<log>``, the lines its ``show`` picks echoed
with its name); a job whose ``done()`` is already true is skipped, so calling again resumes a study
(the processes themselves resume from their checkpoints). With ``deadline_s``: every job is told to
stop at ``end - save_s`` (``stop_flag=<unix time>``, or a command made when the job starts; a
trainer then saves a checkpoint and exits), gets SIGTERM at ``end - kill_s`` and SIGKILL at ``end``
(no signal with ``kill_s=None``: the jobs stop themselves); no job starts with less than
``min_start_s`` left. Progress lines read the last ``step <a>/<b>`` a job printed.

A job that fails because the accelerator ran out of memory (its output says so) is retried once, first in
the queue, and from then on fewer jobs run at a time (one fewer than ran beside it when it failed): jobs
sharing one accelerator fit or not depending on what runs beside them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from experiments.runner.logging_utils import fmt_time

_STEP = re.compile(rb"step (\d+)/(\d+)")
_OOM = re.compile(rb"RESOURCE_EXHAUSTED|[Oo]ut of memory")


@dataclasses.dataclass
class Job:
  name: str
  command: list[str] | Callable[[], list[str]]  # a callable: the command made as the job starts
  log: str
  # whether its work is finished; None: the process knows, its exit code 0 says done
  done: Callable[[], bool] | None = lambda: False
  stop_flag: str | None = "--stop_at_time"
  show: Callable[[str], bool] | None = None  # the output lines echoed, prefixed with the name


@dataclasses.dataclass
class _Running:
  job: Job
  proc: subprocess.Popen
  started: float
  seen: list = dataclasses.field(default_factory=list)  # (time, step, total) observations
  signalled: str = ""
  log_start: int = 0  # the log's size when the job started
  shown_to: int = 0  # the log's bytes looked at for lines to echo
  partial: bytes = b""  # an unfinished last line


def _echo(r: _Running, out):
  """Echoes the lines of ``r``'s output written since the last call that its ``show`` picks."""
  if r.job.show is None:
    return
  try:
    with open(r.job.log, "rb") as f:
      f.seek(r.shown_to)
      data = f.read()
  except OSError:
    return
  r.shown_to += len(data)
  *lines, r.partial = (r.partial + data).split(b"\n")
  for line in lines:
    text = line.decode(errors="replace")
    if r.job.show(text):
      print(f"[{r.job.name}] {text}", file=out, flush=True)


def last_step(log: str) -> tuple[int, int] | None:
  """(step, total) of the last progress line in ``log`` (reads only its tail)."""
  try:
    with open(log, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 16384))
      found = _STEP.findall(f.read())
  except OSError:
    return None
  return (int(found[-1][0]), int(found[-1][1])) if found else None


def ran_out_of_memory(log: str, start: int = 0) -> bool:
  """Whether the output written to ``log`` after byte ``start`` reports an out-of-memory error."""
  try:
    with open(log, "rb") as f:
      f.seek(start)
      return bool(_OOM.search(f.read()))
  except OSError:
    return False


def last_outcome(log: str) -> str:
  """What the last run recorded in ``log`` reached: 'stopped at step a/b', 'failed: out of memory',
  'failed before its first step', or 'not run' (no log)."""
  try:
    with open(log, "rb") as f:
      text = f.read().rsplit(b"\n$ ", 1)[-1]
  except OSError:
    return "not run"
  steps = _STEP.findall(text)
  if _OOM.search(text):
    return "failed: out of memory" + (
      f" at step {int(steps[-1][0])}" if steps else " before its first step"
    )
  if steps:
    return f"stopped at step {int(steps[-1][0])}/{int(steps[-1][1])}"
  return "failed before its first step"


def _rate(r: _Running) -> float | None:
  """Steps per second between the first and the last observation after the first progress line."""
  if len(r.seen) < 2 or r.seen[-1][1] <= r.seen[0][1]:
    return None
  return (r.seen[-1][1] - r.seen[0][1]) / max(r.seen[-1][0] - r.seen[0][0], 1e-9)


def run_jobs(
  jobs: list[Job],
  parallel: int,
  deadline_s: float = 0,
  *,
  save_s: float = 40,
  kill_s: float | None = 15,
  min_start_s: float = 120,
  progress_every_s: float = 30,
  env: dict | None = None,
  out=sys.stdout,
) -> dict[str, str]:
  """Runs ``jobs``; returns {name: 'done' | 'already done' | 'exit <rc>' | 'stopped' | 'not started'}."""
  if parallel < 1:
    raise ValueError(f"--parallel: must be >= 1, got {parallel}")
  t0 = time.time()
  end = t0 + deadline_s if deadline_s else None
  status = {j.name: "already done" for j in jobs if j.done is not None and j.done()}
  pending = [j for j in jobs if j.name not in status]
  print(
    f"{len(jobs)} jobs: {len(status)} already done, {len(pending)} to run, {parallel} at a time"
    + (f", deadline {fmt_time(deadline_s)}" if end else ""),
    file=out,
    flush=True,
  )
  env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
  running: list[_Running] = []
  last_report, cap, retried = t0, parallel, set()
  while pending or running:
    now = time.time()
    while pending and len(running) < cap and (end is None or end - now >= min_start_s):
      job = pending.pop(0)
      cmd = list(job.command() if callable(job.command) else job.command) + (
        [f"{job.stop_flag}={end - save_s:.0f}"] if end and job.stop_flag else []
      )
      os.makedirs(os.path.dirname(os.path.abspath(job.log)), exist_ok=True)
      with open(job.log, "ab") as log:
        start = log.tell()
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        running.append(_Running(job, proc, now, log_start=start, shown_to=log.tell()))
      print(f"started {job.name} (pid {proc.pid})", file=out, flush=True)
    for r in list(running):
      rc = r.proc.poll()
      _echo(r, out)
      if rc is None:
        continue
      running.remove(r)
      status[r.job.name] = (
        "done"
        if (rc == 0 if r.job.done is None else r.job.done())
        else "stopped"
        if r.signalled or end and time.time() > end - save_s
        else f"exit {rc}"
      )
      if status[r.job.name].startswith("exit") and ran_out_of_memory(r.job.log, r.log_start):
        status[r.job.name] += " (out of memory)"
        if r.job.name not in retried:
          retried.add(r.job.name)
          cap = max(1, min(cap, len(running)))
          pending.insert(0, r.job)
          print(
            f"{r.job.name}: out of memory beside {len(running)} other job(s); retried with at most {cap} "
            "at a time",
            file=out,
            flush=True,
          )
          continue
      print(
        f"{r.job.name}: {status[r.job.name]} after {fmt_time(time.time() - r.started)}",
        file=out,
        flush=True,
      )
    if end and kill_s is not None:
      for r in running:
        left = end - time.time()
        if left <= 0 and r.signalled != "kill":
          r.proc.kill()
          r.signalled = "kill"
        elif left <= kill_s and not r.signalled:
          r.proc.send_signal(signal.SIGTERM)  # a trainer saves a checkpoint and exits
          r.signalled = "term"
    if end and not running and pending and end - time.time() < min_start_s:
      for j in pending:
        status[j.name] = "not started"
      pending = []
    for r in running:
      got = last_step(r.job.log)
      if got and (not r.seen or got[0] != r.seen[-1][1]):
        r.seen.append((time.time(), got[0], got[1]))
    if running and time.time() - last_report >= progress_every_s:
      last_report = time.time()
      print(progress_report(running, pending, t0, end), file=out, flush=True)
    time.sleep(0.5)
  return status


def progress_report(running, pending, t0, end) -> str:
  lines = [
    f"[{fmt_time(time.time() - t0)}] {len(running)} running, {len(pending)} waiting"
    + (f", {fmt_time(max(end - time.time(), 0))} to the deadline" if end else "")
  ]
  for r in running:
    if not r.seen:
      lines.append(f"  {r.job.name}: starting ({fmt_time(time.time() - r.started)})")
      continue
    _, step, total = r.seen[-1]
    rate = _rate(r)
    eta = None if rate is None else (total - step) / rate
    lines.append(
      f"  {r.job.name}: step {step}/{total}"
      + ("" if rate is None else f", {rate:.2f} steps/s, ETA {fmt_time(eta)}")
      + (
        ""
        if eta is None or end is None or time.time() + eta < end
        else " (past the deadline: it will stop with a checkpoint and resume on the next call)"
      )
    )
  return "\n".join(lines)
