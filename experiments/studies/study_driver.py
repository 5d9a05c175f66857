"""Runs a length-generalisation study's (arm x stage) work items: per arm (a model variant; one
study calls it a mixer), pretraining from the zero state and evaluations of its checkpoints, then a
post-training with each initial-state strategy and an evaluation of each. Resumable (a completed
run or evaluation is skipped, a stopped run resumes from its checkpoint), bounded by a deadline
(a running training saves a checkpoint, nothing new starts), the arms one after another in this
process or several at a time as child processes (through ``jobs.run_jobs``, the studies' one
launcher), with progress and an ETA; each call is recorded in ``commands.json`` beside the
results. Every run folder and result is tied to the plan that made
it (``study_plan``): another plan's folder is refused with the difference named, another plan's
result is never reused, what is skipped is said, and nothing is written inside the repository
(``publish`` copies the results into ``docs/results`` when asked).

A study describes itself with a ``Study``: its module (``python -m``), the word for an arm (its
flag is ``--<unit>s``) and three functions of (plan, arm, ...): the work still to do, a training
and an evaluation. Its plan has ``preset``, ``workdir``, ``results``, ``strategies``,
``pretrain_steps``, ``post_steps``, ``tokens_per_step``, ``deadline`` (a ``Deadline``),
``run_dir(arm, stage)`` and ``config(arm, stage)``; a plan whose arms differ in length has
``steps(arm, stage)`` instead of the two step counts. A study's work may grow as its results arrive
(a stage that only some evaluations call for): an arm's work is asked for again once done.

Its command line: ``define_flags`` defines the flags every study takes (and the optional ones of
``SHARED_FLAGS`` it names), ``main`` makes its plan from them and runs it (``conclude``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable

from absl import flags, logging

from experiments import schema
from experiments.runner.logging_utils import fmt_time, write_json
from experiments.studies import jobs, study_plan

# an evaluated token costs about a third of a trained one (forward only), for the ETA
EVAL_COST = 1 / 3
# the lines of a child's output shown (prefixed with its arm) besides those with "Error"
SHOWN = ("study:", "step ", "final eval", "excess NLL", "Traceback", "Config error")


@dataclasses.dataclass(frozen=True)
class Study:
  """What the driver runs of a study. Its plan's arms are ``plan.<unit>s``, chosen by
  ``--<unit>s``."""

  module: str  # python -m <module> runs the study
  unit: str  # what an arm is called in the flags and output ('arm', 'mixer')
  work: Callable  # (plan, arm) -> [(kind 'train' | 'eval', stage, units)] still to do, in order
  train: Callable  # (plan, arm, stage) -> the run's summary, None when the deadline stopped it
  evaluate: Callable  # (plan, arm, stage) -> the meter's line, None when nothing is left to do


# ------------------------------------------------------------------------------------------ plan
def check_choice(flag: str, value, choices):
  if value not in choices:
    raise ValueError(f"{flag}: expected one of {list(choices)}, got {value!r}")


def check_strategies(strategies) -> tuple[str, ...]:
  strategies = tuple(strategies)
  bad = [s for s in strategies if s not in schema.INITIAL_STATES]
  if bad:
    raise ValueError(
      f"--strategies: unknown {bad}; expected names from {list(schema.INITIAL_STATES)}"
    )
  return strategies


def check_non_negative(**flags):
  for name, v in flags.items():
    if v < 0:
      raise ValueError(f"--{name}: must be >= 0, got {v}")


def check_resamples(resamples: int):
  if resamples < 100:
    raise ValueError(f"--resamples: use at least 100 bootstrap resamples, got {resamples}")


def parse_overrides(items) -> dict:
  """['model.num_layers=1', ...] (or a dict) -> {dotted key: Python literal or string}."""
  if isinstance(items, dict):
    return dict(items)
  out = {}
  for item in items:
    key, sep, text = item.partition("=")
    if not sep or not key:
      raise ValueError(
        f"--override: expected key=value (a run-config key such as model.num_layers=1), "
        f"got {item!r}"
      )
    try:
      out[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[key] = text
  return out


def apply_overrides(config, overrides: dict):
  """Sets each dotted key in ``config``; a ValueError names a key the config lacks."""
  for key, value in overrides.items():
    node, parts = config, key.split(".")
    for p in parts[:-1]:
      if p not in node:
        raise ValueError(f"--override: unknown config key {key!r}")
      node = node[p]
    if parts[-1] not in node:
      raise ValueError(f"--override: unknown config key {key!r}")
    try:
      node[parts[-1]] = value
    except TypeError as e:
      raise ValueError(f"--override: {key}={value!r}: {e}") from None


class Deadline:
  """A wall-clock end ``seconds`` from now (none for 0)."""

  def __init__(self, seconds: float):
    self.end = time.time() + seconds if seconds else None

  def left(self) -> float | None:
    return None if self.end is None else self.end - time.time()

  def passed(self) -> bool:
    return self.end is not None and time.time() >= self.end


# ------------------------------------------------------------------------------------------ files
def read_json(path):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def stage_steps(plan, arm, stage) -> int:
  """The training steps of one run: ``plan.steps(arm, stage)`` where the plan has it, else the
  plan's ``pretrain_steps`` / ``post_steps``."""
  if hasattr(plan, "steps"):
    return int(plan.steps(arm, stage))
  return plan.pretrain_steps if stage == "pretrain" else plan.post_steps


def trained(workdir, steps) -> bool:
  s = read_json(os.path.join(workdir, "summary.json"))
  return bool(s) and s.get("status") == "completed" and int(s.get("step", 0)) >= steps


def checkpoint_steps(workdir) -> list[int]:
  root = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(root):
    return []
  return sorted(
    int(s)
    for s in os.listdir(root)
    if s.isdigit() and os.path.isdir(os.path.join(root, s, "state"))
  )


def result_path(plan, arm, stage, step=None):
  """``<results>/<arm>.pretrain.step<k>.json``, ``<results>/<arm>.<strategy>.json``."""
  name = f"{arm}.{stage}" + (f".step{step}" if stage == "pretrain" else "") + ".json"
  return os.path.join(plan.results, name)


# ------------------------------------------------------------------------------------------ work
def done(plan, arm, evaluated, path, step) -> bool:
  """Whether the result at ``path`` is ``step``'s, made by this plan (``evaluated(plan, path,
  step)``: the study's own check of the JSON)."""
  return study_plan.current(plan, arm, path) and evaluated(plan, path, step)


def stage_work(plan, arm, evaluated, pretrain_evals, eval_units) -> list[tuple]:
  """(kind, stage, units) still to do for one arm, in order (units: trained-token equivalents):
  pretraining, ``pretrain_evals`` evaluations of its checkpoints, then per strategy its
  post-training and an evaluation of the last checkpoint. ``evaluated(plan, path, step)``: whether
  the JSON at ``path`` is that step's with the plan's settings; a result of another plan, or of a
  plan not yet checked by ``study_plan.lock``, never counts."""
  work = []
  pre = plan.run_dir(arm, "pretrain")
  if not trained(pre, plan.pretrain_steps):
    work.append(("train", "pretrain", plan.pretrain_steps * plan.tokens_per_step))
  ok = [
    s
    for s in checkpoint_steps(pre)
    if done(plan, arm, evaluated, result_path(plan, arm, "pretrain", s), s)
  ]
  work += [("eval", "pretrain", eval_units)] * max(pretrain_evals - len(ok), 0)
  for s in plan.strategies:
    wd = plan.run_dir(arm, s)
    if not trained(wd, plan.post_steps):
      work.append(("train", s, plan.post_steps * plan.tokens_per_step))
    steps = checkpoint_steps(wd)
    if not (steps and done(plan, arm, evaluated, result_path(plan, arm, s), steps[-1])):
      work.append(("eval", s, eval_units))
  return work


def next_eval_step(plan, arm, stage, evaluated, last_only=False) -> int | None:
  """The checkpoint of ``stage`` to evaluate next: of a pretraining the first kept one (with
  ``last_only``, the last) without its JSON, None when none is left; of a post-training the last."""
  steps = checkpoint_steps(plan.run_dir(arm, stage))
  if stage != "pretrain":
    return steps[-1]
  todo = [
    s
    for s in (steps[-1:] if last_only else steps)
    if not done(plan, arm, evaluated, result_path(plan, arm, stage, s), s)
  ]
  return todo[0] if todo else None


def skipped(plan, arm) -> str | None:
  """What this plan already did for ``arm`` (and will skip), in one line; None for nothing."""
  parts = []
  for stage in study_plan.stages(plan):
    wd, steps = plan.run_dir(arm, stage), stage_steps(plan, arm, stage)
    if trained(wd, steps):
      parts.append(f"{stage} trained ({steps} steps)")
    elif checkpoint_steps(wd):
      parts.append(f"{stage} resumes from step {checkpoint_steps(wd)[-1]}")
  kept = [
    os.path.basename(p)
    for p in study_plan.arm_results(plan, arm)
    if study_plan.current(plan, arm, p)
  ]
  if kept:
    parts.append(f"{len(kept)} results of this plan kept ({', '.join(kept)})")
  return f"study: {arm}: skipped, done by this plan: {'; '.join(parts)}" if parts else None


class Meter:
  """Progress over the study's work in trained-token equivalents, with an ETA from this call's
  rate."""

  def __init__(self, todo_units):
    self.total, self.done, self.t0 = max(sum(todo_units), 1e-9), 0.0, time.time()

  def add(self, units, what):
    self.done += units
    el = time.time() - self.t0
    eta = el * (self.total - self.done) / max(self.done, 1e-9)
    print(
      f"study: {what} | {100 * self.done / self.total:.0f}% of the remaining work | "
      f"{fmt_time(el)} elapsed | ETA {fmt_time(eta)}",
      flush=True,
    )


def time_steps(config, workdir: str, steps: int, fast_compile: bool) -> tuple[dict, float]:
  """Trains ``config`` alone for ``steps`` steps in a fresh ``workdir`` (no checkpoints, one
  evaluation batch) for a study's --measure_throughput; returns the run's summary (its
  ``steady_tokens_per_s``) and the wall seconds, compile included."""
  import shutil  # pylint: disable=g-import-not-at-top

  from experiments.runner import lr_sweep  # pylint: disable=g-import-not-at-top  (imports jax)

  config.train.num_steps, config.train.log_every = steps, max(1, steps // 8)
  config.train.eval_batches = 1
  config.checkpoint.enabled = False
  config.checkpoint.keep_steps = ""
  config.optim.warmup_steps = 1
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run each time: nothing resumed
  t0 = time.time()
  with lowest_optimisation(fast_compile):
    tr = lr_sweep.make_trainer(config, workdir)
    try:
      summary = tr.run()
    finally:
      tr.close()
  return summary, time.time() - t0


@contextlib.contextmanager
def lowest_optimisation(on: bool):
  """XLA's backend at its lowest optimisation level inside the block (a jit cache key: no stale
  programs)."""
  import jax  # pylint: disable=g-import-not-at-top

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", on or before)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@contextlib.contextmanager
def compilation_cache(workdir):
  """Runs of one arm share compiled programs (the evaluation's prefill is the same program for
  every checkpoint of an arm): a persistent cache (JAX_COMPILATION_CACHE_DIR, else one in the
  workdir), the previous settings restored after. On the CPU backend only a cache the caller set
  is used: small programs compile in seconds there, and serialising an XLA:CPU executable into
  the cache aborted the process once in the test suite (jax 0.10.2)."""
  import jax  # pylint: disable=g-import-not-at-top

  if jax.default_backend() == "cpu" and not jax.config.values["jax_compilation_cache_dir"]:
    yield
    return
  keys = {
    "jax_compilation_cache_dir": (
      jax.config.values["jax_compilation_cache_dir"] or os.path.join(workdir, "xla_cache")
    ),
    "jax_persistent_cache_min_compile_time_secs": 0.5,
  }
  before = {k: jax.config.values[k] for k in keys}
  for k, v in keys.items():
    jax.config.update(k, v)
  try:
    yield
  finally:
    for k, v in before.items():
      jax.config.update(k, v)


@contextlib.contextmanager
def stop_after(trainer, seconds: float | None):
  """Inside the block, ``trainer`` is asked to stop ``seconds`` from now (never for None): it checks
  the request every step, saves a checkpoint and returns, as on SIGTERM."""
  timer = None
  if seconds is not None:
    timer = threading.Timer(max(seconds, 0.0), lambda: setattr(trainer, "_stop_requested", True))
    timer.daemon = True
    timer.start()
  try:
    yield
  finally:
    if timer:
      timer.cancel()


def train(plan, arm, stage, fast_compile: bool) -> dict | None:
  """Trains one run (resuming); returns its summary, None when the deadline stopped it (the
  trainer saved a checkpoint)."""
  from experiments.runner import lr_sweep  # pylint: disable=g-import-not-at-top  (imports jax)

  with lowest_optimisation(fast_compile):
    tr = lr_sweep.make_trainer(plan.config(arm, stage), plan.run_dir(arm, stage))
    try:
      with stop_after(tr, plan.deadline.left()):
        summary = tr.run()
    finally:
      tr.close()
  return summary if summary.get("status") == "completed" else None


def run_arm(study, plan, arm, meter=None) -> str:
  """Pretrain, evaluate, post-train and evaluate one arm; returns 'done' or 'deadline'. The arm's
  work is asked for again once done (it may have grown with the results), until it is empty or
  unchanged."""
  work = study.work(plan, arm)
  meter = meter or Meter([u for *_, u in work])
  while work:
    if _run_work(study, plan, arm, work, meter) == "deadline":
      return "deadline"
    again = study.work(plan, arm)
    if again == work:  # nothing moved it on (an evaluation that found nothing to evaluate)
      break
    meter.total += sum(u for *_, u in again)
    work = again
  return "done"


def _run_work(study, plan, arm, work, meter) -> str:
  for kind, stage, units in work:
    if plan.deadline.passed():
      print(f"study: {arm}: deadline reached before {kind} {stage}; rerun to go on", flush=True)
      return "deadline"
    if kind == "train":
      print(
        f"study: {arm}: training {stage} ({stage_steps(plan, arm, stage)} steps) in "
        f"{plan.run_dir(arm, stage)}",
        flush=True,
      )
      if study.train(plan, arm, stage) is None:
        print(
          f"study: {arm}: {stage} stopped at the deadline (checkpoint saved); rerun to go on",
          flush=True,
        )
        return "deadline"
      meter.add(units, f"{arm} {stage} trained")
      continue
    before = {p: os.stat(p).st_mtime_ns for p in study_plan.arm_results(plan, arm)}
    line = study.evaluate(plan, arm, stage)
    written = [
      p for p in study_plan.arm_results(plan, arm) if before.get(p) != os.stat(p).st_mtime_ns
    ]
    study_plan.stamp(study, plan, arm, written)
    if line is not None:
      meter.add(units, line)
  return "done"


# ------------------------------------------------------------------------------------------ drivers
def run_in_process(study, plan, arms) -> str:
  """The arms one after another in this process; returns 'done' or 'deadline'. A PlanError (one
  line) before any work when a folder belongs to another plan."""
  study_plan.lock(study, plan, arms)
  os.makedirs(plan.results, exist_ok=True)
  import jax  # pylint: disable=g-import-not-at-top

  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  dispatch.warm_kernel_imports()
  work = {a: study.work(plan, a) for a in arms}
  n = sum(len(w) for w in work.values())
  print(
    f"study: preset {plan.preset}, {study.unit}s {', '.join(arms)}, strategies "
    f"{', '.join(plan.strategies)}: {n} trainings/evaluations to do in {plan.workdir}",
    flush=True,
  )
  for a in arms:
    line = skipped(plan, a)
    if line:
      print(line, flush=True)
  meter = Meter([u for w in work.values() for *_, u in w])
  with compilation_cache(plan.workdir):
    for a in arms:
      if run_arm(study, plan, a, meter) == "deadline":
        return "deadline"
      # The next arm compiles its own programs; XLA:CPU keeps memory mappings for every
      # executable jax's caches hold, and a process past vm.max_map_count dies in a compile.
      jax.clear_caches()
  return "done"


def child_command(study, plan, arm, argv_flags) -> list[str]:
  """One arm of a parallel study: this call's flags, the arm's and the deadline left."""
  flag = f"--{study.unit}s="
  cmd = [sys.executable, "-m", study.module, f"{flag}{arm}", "--parallel=1", "--child"]
  cmd += [a for a in argv_flags if not a.startswith((flag, "--parallel=", "--deadline_s="))]
  left = plan.deadline.left()
  if left is not None:
    cmd.append(f"--deadline_s={max(int(left), 1)}")
  return cmd


def run_parallel(study, plan, arms, parallel, argv_flags) -> str:
  """One process per arm, ``parallel`` at a time (``jobs.run_jobs``, the studies' one launcher),
  each started with the deadline left then; its output in ``<workdir>/<arm>.log``, the lines in
  ``SHOWN`` and those with "Error" echoed. Returns 'done' or 'incomplete'."""
  os.makedirs(plan.workdir, exist_ok=True)
  print(
    f"study: preset {plan.preset}, {len(arms)} {study.unit}s, {parallel} processes at a time; "
    f"logs in {plan.workdir}/<{study.unit}>.log",
    flush=True,
  )
  arm_jobs = [
    jobs.Job(
      arm,
      functools.partial(child_command, study, plan, arm, argv_flags),
      os.path.join(plan.workdir, f"{arm}.log"),
      done=None,  # the child checks its own work: exit code 0 is done, 3 the deadline
      stop_flag=None,  # the child's --deadline_s, made as it starts
      show=lambda line: line.startswith(SHOWN) or "Error" in line,
    )
    for arm in arms
  ]
  left = plan.deadline.left()
  outcomes = jobs.run_jobs(
    arm_jobs,
    parallel,
    0 if left is None else max(left, 1e-3),
    save_s=0,
    kill_s=None,  # a child stops itself: a training with a checkpoint, nothing new starts
    min_start_s=0,
    env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
  )
  outcomes = {a: outcomes[a] for a in arms}
  print(f"study: {outcomes}", flush=True)
  return "done" if all(v == "done" for v in outcomes.values()) else "incomplete"


def flags_as_written(args) -> list[str]:
  """The command line's flags; a ValueError for a value after a space (the children get the flags
  as written: it would be lost)."""
  loose = [a for a in args if not a.startswith("--")]
  if loose:
    raise ValueError(f"write flags as --name=value (got a separate value {loose[0]!r})")
  return list(args)


def run(study, plan, arms, parallel, argv_flags) -> tuple[str, bool]:
  """What is left of the study: in child processes with ``parallel`` > 1 and several arms, else in
  this one. Returns the status ('done', 'deadline' or 'incomplete') and whether any work was
  left. A PlanError (one line) before any work when a folder belongs to another plan."""
  study_plan.lock(study, plan, arms)
  os.makedirs(plan.results, exist_ok=True)
  pending = any(study.work(plan, a) for a in arms)
  if parallel > 1 and len(arms) > 1:
    return run_parallel(study, plan, arms, parallel, argv_flags), pending
  return run_in_process(study, plan, arms), pending


def write_commands(study, plan, argv_flags, status, wall_s, machine, protocol: str):
  """commands.json beside the results: how they were made (what a person added is kept)."""
  path = os.path.join(plan.results, "commands.json")
  kept = read_json(path) or {}
  calls = kept.get("calls", [])
  calls.append(
    {
      "command": f"python -m {study.module} " + shlex.join(argv_flags),
      "status": status,
      "wall_s": round(wall_s, 1),
      "machine": machine,
    }
  )
  write_json(path, dict(kept, calls=calls, protocol=protocol))


def conclude(study, plan, arms, parallel, argv_flags, *, t0, child, machine, protocol, table):
  """Runs what is left of the study and finishes a command-line call: records it in
  commands.json, writes ``table()`` (markdown) to ``<results>/table.md`` and prints it, and
  publishes when the plan asks. Returns the exit code: 0 done, 2 refused, 3 stopped early."""
  try:
    status, pending = run(study, plan, arms, parallel, argv_flags)
  except study_plan.PlanError as e:
    print(f"Study error: {e}", file=sys.stderr)
    return 2
  wall = time.time() - t0
  if child:  # the parent records the call and renders the table
    return 0 if status == "done" else 3
  if pending:
    write_commands(study, plan, argv_flags, status, wall, machine, protocol(plan))
  text = table()
  with open(os.path.join(plan.results, "table.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print(text, flush=True)
  print(f"study: {status} in {fmt_time(wall)}; results in {plan.results}", flush=True)
  if getattr(plan, "publish", False):
    print(f"study: published to {study_plan.publish(study, plan, arms)}", flush=True)
  return 0 if status == "done" else 3


# ------------------------------------------------------------------------------------------ command line
# flags some studies take: name -> (define, default, help)
SHARED_FLAGS = {
  "pretrain_steps": (flags.DEFINE_integer, 0, "pretraining steps (0: the preset's)"),
  "post_steps": (flags.DEFINE_integer, 0, "post-training steps (0: the preset's)"),
  "post_lr_scale": (
    flags.DEFINE_float,
    0.1,
    "post-training peak rate / pretraining peak rate (a fresh optimizer)",
  ),
  "corpus_dir": (flags.DEFINE_string, "", "prepared corpus (default: the preset's)"),
  "toy_corpus": (
    flags.DEFINE_bool,
    False,
    "generate a small corpus in <workdir>/toy_corpus and train on it (CPU runs without a prepared "
    "corpus; vocabulary 256)",
  ),
  "windows": (flags.DEFINE_integer, 0, "evaluated long-document windows (0: the preset's)"),
  "chunk": (flags.DEFINE_integer, 0, "tokens per carried evaluation chunk (0: the preset's)"),
  "resamples": (flags.DEFINE_integer, 2000, "bootstrap resamples"),
  "seed": (flags.DEFINE_integer, 0, "seed of the window choice and the bootstrap"),
  "fast_compile": (
    flags.DEFINE_bool,
    None,
    "short runs and evaluations compile at XLA's lowest optimisation (same results up to fp32 "
    "summation order; their few steps cost less than the compile). Default: on for tiny",
  ),
}


def define_flags(values, study, presets, strategies, shared="", *, preset_folder=False):
  """Defines in ``values`` the flags every study takes: --preset (one of ``presets``, the first by
  default), --strategies (``strategies`` by default), --workdir, --results (with
  ``preset_folder``, a root holding a folder per preset), --publish, --parallel, --deadline_s,
  --machine, --override, --child; and those of ``SHARED_FLAGS`` named in ``shared`` (a string of
  names)."""
  name, unit = study_plan.study_name(study), study.unit
  flags.DEFINE_enum("preset", presets[0], presets, "model and budget preset", flag_values=values)
  flags.DEFINE_list(
    "strategies",
    list(strategies),
    "post-training initial states (zero = the control)",
    flag_values=values,
  )
  flags.DEFINE_string(
    "workdir",
    "",
    "root of the run folders (default: a folder of /tmp named after the study and preset)",
    flag_values=values,
  )
  flags.DEFINE_string(
    "results",
    "",
    "root of the JSON, a <preset> folder inside (default <workdir>/results)"
    if preset_folder
    else "folder of the JSON (default <workdir>/results/<preset>)",
    flag_values=values,
  )
  flags.DEFINE_bool(
    "publish",
    False,
    f"also copy the results folder into docs/results/{name}/ (replacing those of the same {unit}s)",
    flag_values=values,
  )
  flags.DEFINE_integer(
    "parallel",
    1,
    f"{unit}s at once as separate processes (1: in this process)",
    flag_values=values,
  )
  flags.DEFINE_integer(
    "deadline_s",
    0,
    "stop cleanly after this many seconds (0: none): a running training saves a checkpoint, "
    "nothing new starts; rerun to go on",
    flag_values=values,
  )
  flags.DEFINE_string(
    "machine", "", "where the study ran, recorded in commands.json", flag_values=values
  )
  flags.DEFINE_list(
    "override", [], "run-config overrides for every run, key=value", flag_values=values
  )
  flags.DEFINE_bool(
    "child", False, f"internal: one {unit} of a --parallel study", flag_values=values
  )
  for flag in shared.split():
    define, default, text = SHARED_FLAGS[flag]
    define(flag, default, text, flag_values=values)


def plan_from_flags(plan_class, values):
  """``plan_class`` made from the flags its arguments name (``overrides``: --override)."""
  names = inspect.signature(plan_class).parameters
  return plan_class(**{n: values["override" if n == "overrides" else n].value for n in names})


def main(study, values, plan_class, *, protocol, table, prepare=None, instead=None) -> int:
  """A study's command line: its plan from the flags, ``prepare(plan)`` (inputs written or checked,
  before any child process starts) and ``conclude``; bad flags get one ``Study error:`` line and
  exit code 2 before any work. ``protocol(plan)``: the settings in words; ``table(plan)``: the
  results in markdown; ``instead(plan)``, where given, runs in place of the study."""
  if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint read at INFO
    logging.set_verbosity(logging.WARNING)
  t0 = time.time()
  try:
    plan = plan_from_flags(plan_class, values)
    argv_flags = flags_as_written(sys.argv[1:])
    if prepare is not None:
      prepare(plan)
  except (ValueError, schema.ConfigError) as e:
    print(f"Study error: {e}", file=sys.stderr)
    return 2
  if instead is not None:
    instead(plan)
    return 0
  return conclude(
    study,
    plan,
    getattr(plan, f"{study.unit}s"),
    values.parallel,
    argv_flags,
    t0=t0,
    child=values.child,
    machine=values.machine,
    protocol=protocol,
    table=lambda: table(plan),
  )
