"""The training loop of a Trainer (experiments/runner/trainer.py): ``run`` top to bottom in named steps
(start, each step's host work, finish, summary), the SIGTERM stop, and what the loop reports (metric
rows, progress lines, throughput, summary.json). A sweep (experiments/runner/lr_sweep.py) overrides
the reporting."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time

import jax
import numpy as np

from experiments import schema
from experiments.runner import dispatch_window, logging_utils, preemption, sigterm, tracing
from experiments.runner import mfu as mfu_lib
from experiments.runner.loss import check_dropped
from kdn_jax.models import flops as flops_lib


class NonFiniteLossError(FloatingPointError):
  pass


class _Loop:
  """What one call of Trainer.run carries from step to step."""

  def __init__(self, config, start_step: int, writer):
    self.start_step, self.total, self.writer = start_step, config.train.num_steps, writer
    self.tokens_per_step = config.data.global_batch_size * config.data.seq_len
    self.keep_steps = set(schema.parse_keep_steps(schema.setting(config, "checkpoint.keep_steps")))
    self.status, self.t0 = "completed", time.time()
    self.t_log, self.step_log = self.t0, start_step
    self.eval_metrics = {}
    self.pending_finite, self.pending_dropped = [], []
    self.past_first = False  # the first (compiling) step is done
    self.interval_tps = []  # tokens/s of each logged interval after the first (compiling) step
    self.window = dispatch_window.DispatchWindow()
    self.ctx_before = None  # jit's tracing context before the first step


class TrainLoop:
  """Trainer's loop; the model, state, steps and checkpoints it calls are Trainer's."""

  # ---------------------------------------------------------------- loop
  def _on_sigterm(self, signum, frame):  # pylint: disable=unused-argument
    logging.warning("SIGTERM received: saving a checkpoint and exiting")
    self._stop_requested = True

  def _check_finite(self, pending):
    """Raises NonFiniteLossError naming the first step whose loss or gradients were not finite."""
    if not pending:
      return
    flags = np.asarray(jax.device_get([f for _, f in pending]))
    bad = [s for (s, _), f in zip(pending, flags) if not f]
    if bad:
      last = self.checkpointer.latest_step() if self.checkpointer else None
      raise NonFiniteLossError(
        f"non-finite loss/gradients at step {bad[0]}; halting without saving. "
        f"Last good checkpoint: step {last} in {self.workdir}/checkpoints. "
        "Set --config.train.nan_policy=skip to skip such steps instead."
      )

  def run(self, stop_at: int | None = None) -> dict:
    """Trains to ``train.num_steps`` (or stops early at ``stop_at`` like a preemption, saving first)."""
    self.maybe_restore()
    total, start_step = self.config.train.num_steps, self.step()
    if start_step >= total:
      return self._nothing_to_train(start_step, total)
    self._write_run_config(total)
    # Rows past the restored step were written by a run that died before its next checkpoint: they are
    # dropped, so the resumed run's rows replace them instead of appearing twice.
    writer = self._metric_writer(start_step)
    sync_preemption = preemption.service() is not None
    loop = _Loop(self.config, start_step, writer)
    watch = self._install_sigterm(sync_preemption, loop)
    self._announce(start_step, total)
    try:
      step = start_step
      loop.ctx_before = tracing.tracing_context()
      while step < total:
        if (
          self._stop_requested
          or (stop_at is not None and step >= stop_at)
          or (sync_preemption and preemption.reached(step))
        ):
          loop.status = "preempted"
          break
        metrics = self.train_step(next(self.data_iter))
        loop.window.add(metrics["loss"])
        step += 1
        self._after_step(loop, step, metrics)
      self._finish(loop)
    finally:
      self._release(writer, watch)
    summary = self._summary(loop)
    self._write_summary(summary)
    return summary

  # ---------------------------------------------------------------------------- the steps of run()
  def _write_run_config(self, total: int):
    """The run is known to start: its config is the workdir's."""
    if not self.is_main:
      return
    logging_utils.write_json(os.path.join(self.workdir, "config.json"), self.config_json)
    if self.config.optim.warmup_steps > total:
      print(
        f"Note: config.optim.warmup_steps={self.config.optim.warmup_steps} exceeds "
        f"config.train.num_steps={total}: the learning rate rises over all {total} steps and "
        "never reaches its peak or decays",
        flush=True,
      )

  def _install_sigterm(self, sync_preemption: bool, loop: _Loop):
    """The entered SIGTERM watch (sigterm.SigtermWatch): the handler's flag stops the loop with a
    checkpoint, and a SIGTERM before the first step is done (the compile: minutes on a large model)
    ends the process at once, since there is nothing to save yet. None under jax.distributed's
    preemption service, whose handler this would replace, and off the main thread (no handler)."""
    if threading.current_thread() is not threading.main_thread() or sync_preemption:
      return None
    watch = sigterm.SigtermWatch(
      self._on_sigterm,
      lambda: loop.past_first,
      f"SIGTERM before the first step was done: nothing to save; exiting "
      f"(rerun to start again from step {loop.start_step})",
    )
    return watch.__enter__()

  def _announce(self, start_step: int, total: int):
    if self.is_main:
      print(
        f"Training {self.config.model.get('mixer')} model ({self.num_params / 1e6:.2f}M params) on "
        f"{self.config.data.kind}, mesh {dict(self.mesh.shape)}, initial_state={self.strategy}, "
        f"steps {start_step}->{total}",
        flush=True,
      )

  def _after_step(self, loop: _Loop, step: int, metrics: dict):
    """The host's part of a dispatched step: checks at log, eval and save points, the progress line, a
    periodic evaluation and a checkpoint."""
    cfg = self.config
    # Finiteness is checked on the host only at log/eval/save points: a per-step float() would
    # serialise dispatch. Halting then still happens before any checkpoint of a bad state.
    if cfg.train.nan_policy == "halt":
      loop.pending_finite.append((step, metrics["finite"]))
    if cfg.train.loss_positions:  # checked with the finiteness flags, without a per-step sync
      loop.pending_dropped.append((step, metrics["dropped_targets"]))
    at_log = step % cfg.train.log_every == 0 or step == loop.total
    at_save = (
      bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0
    ) or step in loop.keep_steps
    at_eval = bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0
    if step == loop.start_step + 1:
      self._first_step_done(loop, step, metrics)
    if at_log or at_save or at_eval:
      self._check_pending(loop, metrics)
    if at_log:
      self._log_progress(loop, step)
    if at_eval and step < loop.total:
      loop.eval_metrics = self.evaluate()
      loop.writer.write(step, "eval", loop.eval_metrics)
      if self.is_main:
        print(f"eval @ {step}: {self._describe_eval(loop.eval_metrics)}", flush=True)
    if at_save and step < loop.total:
      self.save()

  def _first_step_done(self, loop: _Loop, step: int, metrics: dict):
    """Waits for the first (compiling) step, so compilation stays out of the first interval's tokens/s."""
    jax.block_until_ready(metrics["loss"])
    if self.is_main:
      print(f"first step done in {time.time() - loop.t0:.1f}s (includes compilation)", flush=True)
      grew = tracing.context_growth(loop.ctx_before, tracing.tracing_context())
      if grew:
        logging.warning(grew)
    loop.t_log, loop.step_log = time.time(), step
    loop.past_first = True

  def _check_pending(self, loop: _Loop, metrics: dict):
    """The checks deferred to a log, eval or save point: the asynchronous saves, finiteness and
    the loss positions' dropped targets of every step since the last point."""
    if self.checkpointer is not None:  # an asynchronous save that failed stops the run here
      self.checkpointer.check()
    self._check_finite(loop.pending_finite)
    loop.pending_finite = []
    self.last_metrics = self._host_metrics(metrics)
    for s, d in loop.pending_dropped:
      check_dropped(self.config, jax.device_get(d), f"step {s}")
    loop.pending_dropped = []

  def _log_progress(self, loop: _Loop, step: int):
    """A metrics row and the progress line: tokens/s and ETA over the interval since the last one."""
    now = time.time()
    tps, eta = None, None  # no interval yet right after the (compiling) first step
    if step > loop.step_log:
      tps = (step - loop.step_log) * loop.tokens_per_step / max(now - loop.t_log, 1e-9)
      if loop.past_first:
        loop.interval_tps.append(tps)
      eta = (loop.total - step) * (now - loop.t_log) / max(step - loop.step_log, 1)
      loop.t_log, loop.step_log = now, step
    speed = {} if tps is None else {"tokens_per_s": tps}
    speed.update({k: v for k, v in self._throughput(tps).items() if v is not None})
    loop.writer.write(step, "train", {**self.last_metrics, **speed})
    if self.is_main:
      print(self._progress_line(step, loop.total, tps, eta), flush=True)

  def _finish(self, loop: _Loop):
    """The final evaluation of a completed run, the last checks and the last checkpoint."""
    if loop.status == "completed":
      loop.eval_metrics = self.evaluate()
      loop.writer.write(self.step(), "eval", loop.eval_metrics)
      if self.is_main:
        print(
          f"final eval @ {self.step()}: {self._describe_eval(loop.eval_metrics, final=True)}",
          flush=True,
        )
    self._check_finite(loop.pending_finite)
    self.save(force=True)
    if loop.status == "preempted" and self.is_main:
      print(
        f"Stopped at step {self.step()} (checkpoint saved); rerun the same command to resume.",
        flush=True,
      )

  def _release(self, writer, watch):
    """Waits for the saves in flight, closes the metric writer, restores the SIGTERM handler."""
    try:
      if self.checkpointer is not None:
        self.checkpointer.wait()
    finally:
      writer.close()
      if watch is not None:
        watch.__exit__(None, None, None)

  def _summary(self, loop: _Loop) -> dict:
    elapsed = time.time() - loop.t0
    steady = float(np.median(loop.interval_tps)) if loop.interval_tps else None
    return {
      "status": loop.status,
      "step": self.step(),
      "num_steps": loop.total,
      "wall_time_s": elapsed,
      "steps_this_run": self.step() - loop.start_step,
      "tokens_per_s": (self.step() - loop.start_step) * loop.tokens_per_step / max(elapsed, 1e-9),
      # the median over the logged intervals after the first (compiling) step: an
      # interval that held an eval, a checkpoint or a recompile counts as one slow
      # interval instead of dragging a mean down (a step-2 recompile on GPUs:
      # docs/decisions.md)
      "steady_tokens_per_s": steady,
      # the steady tokens/s as model FLOPs: per device, and against the device's peak (None: no peak
      # known for the device kind, e.g. a CPU)
      "model_flops_per_token": self.model_flops_per_token,
      "device_kind": self.device_peak[0],
      "peak_tflops_per_device": self.device_peak[1],
      "steady_tflops_per_s_per_device": self._throughput(steady).get("tflops_per_s_per_device"),
      "mfu": self._throughput(steady).get("mfu"),
      "num_params": self.num_params,
      "train": self.last_metrics,
      "eval": loop.eval_metrics,
      "initial_state": self.strategy,
      "mesh": dict(self.mesh.shape),
      "init_from": self.config.train.init_from or None,
      "init_from_step": self.init_from_step,
    }

  # ---------------------------------------------------------------- reporting (a sweep overrides these)
  def _metric_writer(self, start_step: int):
    return logging_utils.MetricWriter(
      self.workdir, self.config.logging.tensorboard, self.is_main, resume_step=start_step
    )

  def _host_metrics(self, metrics) -> dict:
    return {k: float(v) for k, v in metrics.items()}

  def _progress_line(self, step, total, tokens_per_s, eta_s) -> str:
    line = logging_utils.progress_line(step, total, self.last_metrics, tokens_per_s, eta_s)
    return line + self._throughput_text(tokens_per_s)

  # members trained per step on each token (a sweep trains several models on the same batch)
  flops_members = 1

  @functools.cached_property
  def model_flops_per_token(self) -> float | None:
    """Training FLOPs per token of all the models one step trains (kdn_jax.models.flops), or None for
    a model the count does not know (another model_factory)."""
    if self.config.model_factory != schema.DEFAULT_MODEL_FACTORY:
      return None
    count = flops_lib.flops_per_token(self.config.model, self.config.data.seq_len)
    return count["train"] * self.flops_members

  @functools.cached_property
  def device_peak(self) -> tuple[str, float | None]:
    """(device kind, its peak TFLOP/s for the model's compute dtype or None)."""
    kind = jax.devices()[0].device_kind
    return kind, mfu_lib.peak_tflops(kind, str(self.config.model.dtype))

  def _throughput(self, tokens_per_s: float | None) -> dict:
    """{'tflops_per_s_per_device', 'mfu'} for ``tokens_per_s`` ({} when either count is missing)."""
    if tokens_per_s is None or self.model_flops_per_token is None:
      return {}
    return mfu_lib.throughput(
      tokens_per_s, self.model_flops_per_token, jax.device_count(), self.device_peak[1]
    )

  def _throughput_text(self, tokens_per_s: float | None) -> str:
    t = self._throughput(tokens_per_s)
    return mfu_lib.describe(t) if t else ""

  def _describe_eval(self, metrics, final=False) -> str:
    return f"loss {metrics['loss']:.4f} {'val ' if final else ''}accuracy {metrics['accuracy']:.4f}"

  def _write_summary(self, summary: dict):
    """Called on every process (a sweep saves its members' checkpoints, which is collective)."""
    if not self.is_main:
      return
    logging_utils.write_summary(self.workdir, summary)
    if self.config.logging.plot:
      logging_utils.plot_loss(self.workdir)

  def _nothing_to_train(self, step: int, total: int) -> dict:
    """A workdir whose checkpoint already reaches train.num_steps: say so (no training, no new rows)."""
    msg = (
      f"Warning: the checkpoint in {self.workdir} is at step {step}, "
      f"{'beyond' if step > total else 'already at'} config.train.num_steps={total}: nothing to train. "
      "Raise --config.train.num_steps to train on, or use a new --workdir."
    )
    if self.is_main:
      print(msg, flush=True)
    else:
      logging.warning(msg)
    out = {
      "status": "completed",
      "step": step,
      "num_steps": total,
      "steps_this_run": 0,
      "warning": msg,
      "initial_state": self.strategy,
    }
    if self._summary_is_stale(step):
      out = self._repair_summary(step, total, out)
    return out

  def _summary_is_stale(self, step: int) -> bool:
    """Whether summary.json misses the run that ended at checkpoint ``step`` (the run was killed between its
    last checkpoint and its summary): absent, unreadable, or of another step or status. The same answer on
    every process (process 0's)."""
    stale = False
    if self.is_main:
      try:
        with open(os.path.join(self.workdir, "summary.json"), encoding="utf-8") as f:
          old = json.load(f)
        stale = old.get("step") != step or old.get("status") != "completed"
      except (OSError, ValueError, AttributeError):
        stale = True
    if self.process_count > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      stale = bool(multihost_utils.broadcast_one_to_all(np.int32(stale)))
    return stale

  def _repair_summary(self, step: int, total: int, out: dict) -> dict:
    """Rebuilds summary.json from the checkpoint: its training metrics and a fresh evaluation of its
    parameters (the same numbers the run's final evaluation gave: same parameters, same batches)."""
    record = self.checkpointer.record(step)
    self.last_metrics = {
      k: np.asarray(v) if isinstance(v, list) else v
      for k, v in (record.get("metrics") or {}).items()
    }
    summary = dict(
      out,
      train=self.last_metrics,
      eval=self.evaluate(),
      num_params=self.num_params,
      mesh=dict(self.mesh.shape),
      init_from=self.config.train.init_from or None,
      init_from_step=self.init_from_step,
      repaired=True,
      warning=f"{out['warning']} summary.json was missing or stale (the run ended before writing "
      f"it); rebuilt from the checkpoint at step {step}.",
    )
    self._write_summary(summary)
    if self.is_main:
      print(f"Rebuilt {self.workdir}/summary.json from the checkpoint at step {step}", flush=True)
    return summary
