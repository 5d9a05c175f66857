"""SIGTERM is seen at once by a helper thread: before the run's first step it ends the process (there is
nothing to save) with one line; after it, only the handler's flag is set (the loop saves and stops)."""

from __future__ import annotations

import os
import signal
import threading
import time

from runner_helpers import run_one_device

from experiments.runner import sigterm


def _watch(started, capsys):
  flagged, exited, done = [], [], threading.Event()

  def exit_now(code):
    exited.append(code)
    done.set()

  watch = sigterm.SigtermWatch(
    lambda *a: flagged.append(True), lambda: started, "nothing to save", exit_now=exit_now
  )
  with watch:
    os.kill(os.getpid(), signal.SIGTERM)
    done.wait(5 if not started else 0.5)
  return flagged, exited, capsys.readouterr().err


def test_before_the_first_step_sigterm_exits_at_once(capsys):
  flagged, exited, err = _watch(False, capsys)
  assert exited == [128 + signal.SIGTERM] and err == "nothing to save\n"


def test_after_the_first_step_sigterm_only_sets_the_flag(capsys):
  before = signal.getsignal(signal.SIGTERM)
  flagged, exited, err = _watch(True, capsys)
  assert flagged == [True] and exited == [] and err == ""
  assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_at_most_two_steps_in_flight(monkeypatch):
  """The loop waits for step n - 2 before dispatching more: a stop waits for two steps, not for every
  step dispatched since the last log line."""
  from experiments.runner import dispatch_window  # pylint: disable=g-import-not-at-top

  waited = []
  monkeypatch.setattr(dispatch_window.jax, "block_until_ready", waited.append)
  window = dispatch_window.DispatchWindow()
  for step in range(1, 6):
    window.add(f"loss of step {step}")
    assert waited == [f"loss of step {s}" for s in range(1, step - 1)]


_FIRST_STEP_BLOCKS = """
import os, signal, sys, time
sys.path.insert(0, "tests")
from runner_helpers import tiny_config
from experiments.runner import trainer

tr = trainer.Trainer(tiny_config(), sys.argv[1])

def first_step(batch):  # a compile that takes minutes, with the SIGTERM arriving inside it
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(60)
  raise AssertionError("the SIGTERM did not end the process during the first step")

tr.train_step = first_step
tr.run()
"""


def test_a_trainer_ends_at_once_on_sigterm_during_its_first_step(tmp_path):
  """The watch is installed by Trainer.run: a SIGTERM inside the first step (Python's handler
  waits for the main thread, which sits in the compile) ends the process within a second."""
  t0 = time.monotonic()
  out = run_one_device(["-c", _FIRST_STEP_BLOCKS, str(tmp_path / "run")], timeout=120)
  assert out.returncode == 128 + signal.SIGTERM, out.stderr[-2000:]
  assert "SIGTERM before the first step was done: nothing to save" in out.stderr
  assert time.monotonic() - t0 < 50  # far less than the 60 s step
