"""The length-generalisation study on the synthetic topic source (configs/lengen_synthetic.py): per
mixer, pretrain from the zero state, post-train with each initial-state strategy, and measure the
excess NLL over the source's exact Bayes floor by position (the ``topic_floor`` evaluation suite).

    # CPU, a few minutes: every stage at tiny size
    python -m experiments.studies.lengen_synthetic --preset=tiny
    # one GPU, the four mixers side by side; resumable, stops cleanly at the deadline
    python -m experiments.studies.lengen_synthetic --preset=default --parallel=4 --deadline_s=540 \\
        --workdir=/tmp/lengen_synthetic --results=docs/results/lengen_synthetic

Runs: ``<workdir>/<mixer>/pretrain`` (``<preset>,<mixer>``), then ``<workdir>/<mixer>/<strategy>``
(``<preset>_post`` / ``post``, ``--config.train.init_from`` the pretrained run) for each strategy;
``zero`` post-training is the control. Evaluated: every kept pretraining checkpoint
(``--all_checkpoints``; the trend with training tokens) or only the last, and each post-trained run.
Each evaluation writes one JSON into ``<results>/<preset>/`` (``<mixer>.pretrain.step<k>.json``,
``<mixer>.<strategy>.json``); experiments/studies/results/lengen_synthetic.py renders them. A
completed run or evaluation is skipped; a stopped run resumes from its checkpoint. ``--parallel=N``
runs up to N mixers as separate processes (one accelerator shared); their output is prefixed with
the mixer and kept in ``<workdir>/<mixer>.log``.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

from absl import app, flags, logging
from absl import flags as absl_flags

from configs import lengen_synthetic as study_config
from experiments.runner import cli, config_lib
from experiments.runner.logging_utils import fmt_time, write_json
from experiments.studies.results import lengen_synthetic as renderer

PRESETS = ("tiny", "default")
POST_PRESET = {"tiny": "tiny_post", "default": "post"}
STRATEGIES = ("zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
DEFAULT_MIXERS = {"tiny": ("gla",), "default": ("mamba2", "gla", "kda", "kdn_diag")}
EVAL = {"tiny": {"documents": 16, "chunk": 2048}, "default": {"documents": 64, "chunk": 512}}
MAX_LEN = 8192
EVAL_COST = (
  1 / 3
)  # an evaluated token costs about a third of a trained one (forward only), for the ETA

FLAGS = flags.FlagValues()
flags.DEFINE_enum(
  "preset",
  "tiny",
  PRESETS,
  "model and budget preset (configs/lengen_synthetic.py)",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "mixers", [], "mixers (default: tiny gla; default mamba2,gla,kda,kdn_diag)", flag_values=FLAGS
)
flags.DEFINE_list(
  "strategies",
  list(STRATEGIES),
  "post-training initial-state strategies (zero = the control)",
  flag_values=FLAGS,
)
flags.DEFINE_string(
  "workdir",
  "",
  "root of the run folders (default /tmp/lengen_synthetic_<preset>)",
  flag_values=FLAGS,
)
flags.DEFINE_string(
  "results",
  "docs/results/lengen_synthetic",
  "root of the per-run JSON (a <preset>/ folder inside)",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "parallel", 1, "mixers run at once as separate processes (1: in this process)", flag_values=FLAGS
)
flags.DEFINE_integer(
  "deadline_s",
  0,
  "stop cleanly after this many seconds (0: none): a running training "
  "saves a checkpoint, nothing new starts; rerun to go on",
  flag_values=FLAGS,
)
flags.DEFINE_integer("pretrain_steps", 0, "pretraining steps (0: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer(
  "post_steps", 0, "post-training steps (0: 10% of the pretraining steps)", flag_values=FLAGS
)
flags.DEFINE_integer(
  "documents", 0, "evaluation documents (0: tiny 16, default 64)", flag_values=FLAGS
)
flags.DEFINE_integer(
  "chunk", 0, "tokens per carried evaluation chunk (0: tiny 2048, default 512)", flag_values=FLAGS
)
flags.DEFINE_integer("max_len", MAX_LEN, "evaluated positions per document", flag_values=FLAGS)
flags.DEFINE_integer("resamples", 2000, "bootstrap resamples", flag_values=FLAGS)
flags.DEFINE_bool(
  "all_checkpoints",
  None,
  "evaluate every kept pretraining checkpoint (default: on for the default preset, off for tiny)",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "fast_compile",
  None,
  "post-training runs compile at XLA's lowest backend optimisation "
  "(the test suite's setting; same results up to fp32 summation order): their few dozen "
  "steps cost less than the compile. Default: on for tiny",
  flag_values=FLAGS,
)
flags.DEFINE_string(
  "machine", "", "where the study ran, recorded in commands.json", flag_values=FLAGS
)
flags.DEFINE_bool(
  "plots",
  False,
  "copy each evaluation's PNG (excess NLL by position with its band) beside its JSON",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "override",
  [],
  "run-config overrides applied to every run, key=value (e.g. "
  "model.num_layers=1,data.topic.switch_prob=0.001)",
  flag_values=FLAGS,
)
flags.DEFINE_bool("child", False, "internal: one mixer of a --parallel study", flag_values=FLAGS)


# ------------------------------------------------------------------------------------------ plan
class Plan:
  """The study's settings after defaults, validated before any work."""

  def __init__(
    self,
    preset,
    mixers=(),
    strategies=STRATEGIES,
    workdir="",
    results="",
    pretrain_steps=0,
    post_steps=0,
    documents=0,
    chunk=0,
    max_len=MAX_LEN,
    resamples=2000,
    all_checkpoints=None,
    deadline_s=0,
    overrides=(),
    fast_compile=None,
    plots=False,
  ):
    if preset not in PRESETS:
      raise ValueError(f"--preset: expected one of {list(PRESETS)}, got {preset!r}")
    self.preset = preset
    self.mixers = tuple(mixers) or DEFAULT_MIXERS[preset]
    bad = [m for m in self.mixers if m not in config_lib.MIXERS]
    if bad:
      raise ValueError(f"--mixers: unknown {bad}; expected names from {list(config_lib.MIXERS)}")
    self.strategies = tuple(strategies)
    bad = [s for s in self.strategies if s not in config_lib.INITIAL_STATES]
    if bad:
      raise ValueError(
        f"--strategies: unknown {bad}; expected names from {list(config_lib.INITIAL_STATES)}"
      )
    for name, v in (
      ("--pretrain_steps", pretrain_steps),
      ("--post_steps", post_steps),
      ("--documents", documents),
      ("--chunk", chunk),
      ("--deadline_s", deadline_s),
    ):
      if v < 0:
        raise ValueError(f"{name}: must be >= 0, got {v}")
    if max_len < 8192:
      raise ValueError(f"--max_len: the verdict reads positions [4096, 8192); got {max_len}")
    if resamples < 100:
      raise ValueError(f"--resamples: use at least 100 bootstrap resamples, got {resamples}")
    self.workdir = workdir or f"/tmp/lengen_synthetic_{preset}"
    self.results = os.path.join(results or "docs/results/lengen_synthetic", preset)
    base = study_config.get_config(preset)
    self.pretrain_steps = pretrain_steps or int(base.train.num_steps)
    self.post_steps = post_steps or max(1, round(self.pretrain_steps * study_config.POST_FRACTION))
    self.documents = documents or EVAL[preset]["documents"]
    if self.documents < 2:
      raise ValueError(f"--documents: the intervals need >= 2 documents, got {self.documents}")
    self.chunk = chunk or EVAL[preset]["chunk"]
    self.max_len, self.resamples = max_len, resamples
    self.all_checkpoints = preset == "default" if all_checkpoints is None else all_checkpoints
    self.deadline = time.time() + deadline_s if deadline_s else None
    self.fast_compile = preset == "tiny" if fast_compile is None else fast_compile
    self.plots = plots
    self.overrides = parse_overrides(overrides)
    for key, value in self.overrides.items():  # fails here, naming the key, rather than mid-study
      _set(base, key, value)
    self.tokens_per_step = int(base.data.global_batch_size) * int(base.data.seq_len)

  def run_dir(self, mixer, stage):
    return os.path.join(self.workdir, mixer, stage)

  def config(self, mixer, stage):
    """The run config of ``stage`` ('pretrain' or a strategy)."""
    if stage == "pretrain":
      c = study_config.get_config(f"{self.preset},{mixer}")
      steps = self.pretrain_steps
      c.checkpoint.every_steps = max(1, steps // 4)
    else:
      c = study_config.get_config(f"{POST_PRESET[self.preset]},{mixer},{stage}")
      steps = self.post_steps
      c.train.init_from = self.run_dir(mixer, "pretrain")
      c.checkpoint.every_steps = steps
    c.train.num_steps = steps
    c.optim.warmup_steps = steps // 10
    if (
      self.preset == "tiny"
    ):  # a loss plot (matplotlib) and TensorBoard files cost seconds per tiny run
      c.logging.plot = c.logging.tensorboard = False
    for key, value in self.overrides.items():
      _set(c, key, value)
    return c

  def time_left(self):
    return None if self.deadline is None else self.deadline - time.time()

  def past_deadline(self):
    return self.deadline is not None and time.time() >= self.deadline


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


def _set(config, key, value):
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


def read_json(path):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


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


def result_path(plan, mixer, stage, step=None):
  name = f"{mixer}.{stage}" + (f".step{step}" if stage == "pretrain" else "") + ".json"
  return os.path.join(plan.results, name)


def evaluated(plan, path, step) -> bool:
  r = read_json(path)
  return (
    bool(r)
    and r.get("step") == step
    and r["topic_floor"]["documents"] == plan.documents
    and r["topic_floor"]["length"] == plan.max_len
  )


# ------------------------------------------------------------------------------------------ work
class Meter:
  """Progress over the study's work in trained-token equivalents, with an ETA from this call's
  rate."""

  def __init__(self, plan, todo_units):
    self.total, self.done, self.t0 = max(sum(todo_units), 1e-9), 0.0, time.time()
    self.plan = plan

  def add(self, units, what):
    self.done += units
    el = time.time() - self.t0
    eta = el * (self.total - self.done) / max(self.done, 1e-9)
    print(
      f"study: {what} | {100 * self.done / self.total:.0f}% of the remaining work | "
      f"{fmt_time(el)} elapsed | ETA {fmt_time(eta)}",
      flush=True,
    )


def _train(plan, mixer, stage) -> dict | None:
  """Trains one run (resuming); returns its summary, None when the deadline stopped it."""
  from experiments.runner import lr_sweep  # pylint: disable=g-import-not-at-top  (imports jax)

  wd = plan.run_dir(mixer, stage)
  with _lowest_optimisation(plan.fast_compile and stage != "pretrain"):
    return _run_trainer(plan, lr_sweep.make_trainer(plan.config(mixer, stage), wd))


def _run_trainer(plan, tr):
  left = plan.time_left()
  timer = None
  if left is not None:  # the trainer checks the flag every step, saves a checkpoint and returns
    timer = threading.Timer(max(left, 0.0), lambda: setattr(tr, "_stop_requested", True))
    timer.daemon = True
    timer.start()
  try:
    summary = tr.run()
  finally:
    if timer:
      timer.cancel()
    tr.close()
  return summary if summary.get("status") == "completed" else None


def _evaluate(plan, mixer, stage, step) -> dict:
  from experiments.evaluation import runner  # pylint: disable=g-import-not-at-top
  from experiments.evaluation.suites import Settings  # pylint: disable=g-import-not-at-top

  wd = plan.run_dir(mixer, stage)
  settings = Settings(
    max_len=plan.max_len, chunk=plan.chunk, documents=plan.documents, resamples=plan.resamples
  )
  t0 = time.time()
  res = runner.evaluate(
    wd, ["topic_floor"], settings, step, os.path.join(wd, "eval", f"step{step}")
  )
  tf = dict(res["topic_floor"])
  for k in ("meta", "bucket_model_nll", "bucket_floor_nll"):
    tf.pop(k, None)
  summary = read_json(os.path.join(wd, "summary.json")) or {}
  record = _record(wd, step)
  init_step = summary.get("init_from_step")
  tokens = (step + (int(init_step) if init_step else 0)) * plan.tokens_per_step
  out = {
    "study": "lengen_synthetic",
    "preset": plan.preset,
    "mixer": mixer,
    "stage": stage,
    "strategy": "zero" if stage == "pretrain" else stage,
    "post_trained": stage != "pretrain",
    "step": step,
    "num_steps": int(summary.get("num_steps", step)),
    "init_from_step": init_step,
    "tokens": tokens,
    "train_len": tf["train_len"],
    "num_params": summary.get("num_params"),
    "train_loss": (record.get("metrics") or {}).get("loss"),
    "val_loss": (summary.get("eval") or {}).get("loss") if summary.get("step") == step else None,
    "train_wall_s": summary.get("wall_time_s"),
    "eval_wall_s": time.time() - t0,
    "topic_floor": tf,
  }
  path = write_json(result_path(plan, mixer, stage, step), out)
  if plan.plots:
    shutil.copyfile(
      os.path.join(wd, "eval", f"step{step}", "topic_floor.png"), path[: -len(".json")] + ".png"
    )
  return out


def _record(workdir, step) -> dict:
  """The JSON record the trainer saved with a checkpoint (orbax's JsonSave file)."""
  return read_json(os.path.join(workdir, "checkpoints", str(step), "record", "metadata")) or {}


def mixer_work(plan, mixer) -> list[tuple]:
  """(kind, stage, units) still to do for one mixer, in order; evaluation steps resolved when
  run."""
  work = []
  pre = plan.run_dir(mixer, "pretrain")
  if not trained(pre, plan.pretrain_steps):
    work.append(("train", "pretrain", plan.pretrain_steps * plan.tokens_per_step))
  eval_units = plan.documents * plan.max_len * EVAL_COST
  n_pre_evals = 4 if plan.all_checkpoints else 1
  done_pre = [
    s for s in checkpoint_steps(pre) if evaluated(plan, result_path(plan, mixer, "pretrain", s), s)
  ]
  work += [("eval", "pretrain", eval_units)] * max(n_pre_evals - len(done_pre), 0)
  for s in plan.strategies:
    wd = plan.run_dir(mixer, s)
    if not trained(wd, plan.post_steps):
      work.append(("train", s, plan.post_steps * plan.tokens_per_step))
    steps = checkpoint_steps(wd)
    if not (steps and evaluated(plan, result_path(plan, mixer, s), steps[-1])):
      work.append(("eval", s, eval_units))
  return work


def run_mixer(plan, mixer, meter=None) -> str:
  """Pretrain, evaluate, post-train and evaluate one mixer; returns 'done' or 'deadline'."""
  meter = meter or Meter(plan, [u for *_, u in mixer_work(plan, mixer)])
  for kind, stage, units in mixer_work(plan, mixer):
    if plan.past_deadline():
      print(f"study: {mixer}: deadline reached before {kind} {stage}; rerun to go on", flush=True)
      return "deadline"
    if kind == "train":
      steps = plan.pretrain_steps if stage == "pretrain" else plan.post_steps
      print(
        f"study: {mixer}: training {stage} ({steps} steps) in {plan.run_dir(mixer, stage)}",
        flush=True,
      )
      if _train(plan, mixer, stage) is None:
        print(
          f"study: {mixer}: {stage} stopped at the deadline (checkpoint saved); rerun to go on",
          flush=True,
        )
        return "deadline"
      meter.add(units, f"{mixer} {stage} trained")
      continue
    wd = plan.run_dir(mixer, stage)
    steps = checkpoint_steps(wd)
    if stage == "pretrain":
      todo = [
        s
        for s in (steps if plan.all_checkpoints else steps[-1:])
        if not evaluated(plan, result_path(plan, mixer, "pretrain", s), s)
      ]
      if not todo:
        continue
      step = todo[0]
    else:
      step = steps[-1]
    r = _evaluate(plan, mixer, stage, step)
    tf = r["topic_floor"]
    meter.add(
      units,
      f"{mixer} {stage} @ step {step} evaluated: PPL late / early {tf['ppl_ratio']['estimate']:.2f} "
      f"[{tf['ppl_ratio']['lo']:.2f}, {tf['ppl_ratio']['hi']:.2f}], {tf['verdict']}",
    )
  return "done"


# ------------------------------------------------------------------------------------------ drivers
@contextlib.contextmanager
def _compilation_cache(workdir):
  """Runs of one mixer share compiled programs (the evaluation's prefill is the same program for
  every checkpoint of a mixer): a persistent cache (JAX_COMPILATION_CACHE_DIR, else one in the
  workdir), the
  previous settings restored after."""
  import jax  # pylint: disable=g-import-not-at-top

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
def _lowest_optimisation(on: bool):
  """XLA's backend at its lowest optimisation level inside the block (a jit cache key: no stale
  programs)."""
  import jax  # pylint: disable=g-import-not-at-top

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", on or before)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def run_in_process(plan) -> str:
  os.makedirs(plan.workdir, exist_ok=True)
  os.makedirs(plan.results, exist_ok=True)
  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  dispatch.warm_kernel_imports()
  work = {m: mixer_work(plan, m) for m in plan.mixers}
  n = sum(len(w) for w in work.values())
  print(
    f"study: preset {plan.preset}, mixers {', '.join(plan.mixers)}, strategies "
    f"{', '.join(plan.strategies)}: {n} trainings/evaluations to do in {plan.workdir}",
    flush=True,
  )
  meter = Meter(plan, [u for w in work.values() for *_, u in w])
  with _compilation_cache(plan.workdir):
    for m in plan.mixers:
      if run_mixer(plan, m, meter) == "deadline":
        return "deadline"
  return "done"


def child_command(plan, mixer, argv_flags) -> list[str]:
  left = plan.time_left()
  cmd = [
    sys.executable,
    "-m",
    "experiments.studies.lengen_synthetic",
    f"--mixers={mixer}",
    "--parallel=1",
    "--child",
  ]
  cmd += [a for a in argv_flags if not a.startswith(("--mixers=", "--parallel=", "--deadline_s="))]
  if left is not None:
    cmd.append(f"--deadline_s={max(int(left), 1)}")
  return cmd


def run_parallel(plan, parallel, argv_flags) -> str:
  """One process per mixer, ``parallel`` at a time, each running its chain with the remaining
  deadline."""
  os.makedirs(plan.workdir, exist_ok=True)
  env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  print(
    f"study: preset {plan.preset}, {len(plan.mixers)} mixers, {parallel} processes at a time; "
    f"logs in {plan.workdir}/<mixer>.log",
    flush=True,
  )
  lock = threading.Lock()

  def one(mixer):
    if plan.past_deadline():
      return mixer, "deadline"
    with open(os.path.join(plan.workdir, f"{mixer}.log"), "a", encoding="utf-8") as log:
      proc = subprocess.Popen(
        child_command(plan, mixer, argv_flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        bufsize=1,
      )
      for line in proc.stdout:
        log.write(line)
        if (
          line.startswith(
            ("study:", "step ", "final eval", "excess NLL", "Traceback", "Config error")
          )
          or "Error" in line
        ):
          with lock:
            print(f"[{mixer}] {line}", end="", flush=True)
      rc = proc.wait()
    return mixer, "done" if rc == 0 else f"rc={rc}"

  with concurrent.futures.ThreadPoolExecutor(max(parallel, 1)) as pool:
    outcomes = dict(pool.map(one, plan.mixers))
  print(f"study: {outcomes}", flush=True)
  return "done" if all(v == "done" for v in outcomes.values()) else "incomplete"


def write_commands(plan, argv_flags, status, wall_s, machine):
  """commands.json beside the results: how they were made (what a person added is kept)."""
  path = os.path.join(plan.results, "commands.json")
  kept = read_json(path) or {}
  calls = kept.get("calls", [])
  calls.append(
    {
      "command": "python -m experiments.studies.lengen_synthetic " + shlex.join(argv_flags),
      "status": status,
      "wall_s": round(wall_s, 1),
      "machine": machine,
    }
  )
  c = plan.config(plan.mixers[0], "pretrain")
  write_json(
    path,
    dict(
      kept,
      calls=calls,
      protocol=(
        f"preset {plan.preset}: {c.model.num_layers} layers, d={c.model.d_model}, "
        f"{c.model.num_heads} heads x {c.model.head_dim}; T={c.data.seq_len}, "
        f"batch {c.data.global_batch_size}; pretraining {plan.pretrain_steps} steps from the zero "
        f"state at lr {c.optim.learning_rate:g}, post-training {plan.post_steps} steps at lr "
        f"{study_config.POST_LR:g} (fresh optimizer); {source_line(c.data.topic)}; "
        f"evaluation: {plan.documents} documents x "
        f"{plan.max_len} positions, state carried in chunks of {plan.chunk}, {plan.resamples} "
        f"bootstrap resamples over documents"
      ),
    ),
  )


def source_line(tp) -> str:
  """The synthetic source's settings in words."""
  if tp.get("family", "hmm") == "dirichlet":
    return (
      f"Dirichlet source: vocabulary {tp.vocab_size}, concentration {tp.concentration:g} per "
      f"token, documents of {tp.doc_len}"
    )
  return (
    f"topic source: vocabulary {tp.vocab_size}, {tp.num_topics} topics, Zipf "
    f"{tp.zipf_exponent:g}, switch probability {tp.switch_prob:.6g}, documents of {tp.doc_len}"
  )


def main(argv):
  del argv
  if not absl_flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint read at INFO
    logging.set_verbosity(logging.WARNING)
  t0 = time.time()
  try:
    plan = Plan(
      FLAGS.preset,
      FLAGS.mixers,
      FLAGS.strategies,
      FLAGS.workdir,
      FLAGS.results,
      FLAGS.pretrain_steps,
      FLAGS.post_steps,
      FLAGS.documents,
      FLAGS.chunk,
      FLAGS.max_len,
      FLAGS.resamples,
      FLAGS.all_checkpoints,
      FLAGS.deadline_s,
      FLAGS.override,
      FLAGS.fast_compile,
      FLAGS.plots,
    )
  except (ValueError, config_lib.ConfigError) as e:
    print(f"Study error: {e}", file=sys.stderr)
    return 2
  loose = [a for a in sys.argv[1:] if not a.startswith("--")]
  if loose:  # the children get the flags as written: a value after a space would be lost
    print(
      f"Study error: write flags as --name=value (got a separate value {loose[0]!r})",
      file=sys.stderr,
    )
    return 2
  argv_flags = list(sys.argv[1:])
  os.makedirs(plan.results, exist_ok=True)
  pending = sum(len(mixer_work(plan, m)) for m in plan.mixers)
  if FLAGS.parallel > 1 and len(plan.mixers) > 1:
    status = run_parallel(plan, FLAGS.parallel, argv_flags)
  else:
    status = run_in_process(plan)
  wall = time.time() - t0
  if FLAGS.child:  # the parent records the call and renders the table
    return 0 if status == "done" else 3
  if pending:
    write_commands(plan, argv_flags, status, wall, FLAGS.machine)

  table = renderer.render_table(renderer.load_runs(plan.results))
  with open(os.path.join(plan.results, "table.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  print(table, flush=True)
  print(f"study: {status} in {fmt_time(wall)}; results in {plan.results}", flush=True)
  return 0 if status == "done" else 3


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
