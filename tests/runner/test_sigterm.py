"""SIGTERM is seen at once by a helper thread: before the run's first step it ends the process (there is
nothing to save) with one line; after it, only the handler's flag is set (the loop saves and stops)."""

from __future__ import annotations

import os
import signal
import threading

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
