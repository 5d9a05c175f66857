"""The length-generalisation study on the synthetic topic source (configs/lengen_synthetic.py): per
mixer, pretrain from the zero state, post-train with each initial-state strategy, and measure the
excess NLL over the source's exact Bayes floor by position (the ``topic_floor`` evaluation suite).

    # CPU, a few minutes: every stage at tiny size
    python -m experiments.studies.lengen_synthetic --preset=tiny
    # one GPU, the four mixers side by side; resumable, stops cleanly at the deadline
    python -m experiments.studies.lengen_synthetic --preset=default --parallel=4 --deadline_s=540 \\
        --workdir=/tmp/lengen_synthetic --publish

Runs: ``<workdir>/<mixer>/pretrain`` (``<preset>,<mixer>``), then ``<workdir>/<mixer>/<strategy>``
(``<preset>_post`` / ``post``, ``--config.train.init_from`` the pretrained run) for each strategy;
``zero`` post-training is the control. Evaluated: every kept pretraining checkpoint
(``--all_checkpoints``; the trend with training tokens) or only the last, and each post-trained run.
Each evaluation writes one JSON into ``<results>/<preset>/`` (default ``<workdir>/results``;
``--publish`` copies them into docs/results/lengen_synthetic/) (``<mixer>.pretrain.step<k>.json``,
``<mixer>.<strategy>.json``); experiments/studies/lengen_synthetic/render.py renders them. A run or
evaluation this plan completed is skipped; a stopped run resumes from its checkpoint; a workdir made
by another plan is refused (study_plan.py). ``--parallel=N``
runs up to N mixers as separate processes (one accelerator shared); their output is prefixed with
the mixer and kept in ``<workdir>/<mixer>.log``.
"""

from __future__ import annotations

import os
import shutil
import time

from absl import flags

from configs import lengen_synthetic as study_config
from experiments import schema
from experiments.runner.logging_utils import write_json
from experiments.studies import study_driver
from experiments.studies.lengen_synthetic import render as renderer
from experiments.studies.results.common import interval

PRESETS = ("tiny", "default")
POST_PRESET = {"tiny": "tiny_post", "default": "post"}
STRATEGIES = ("zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
DEFAULT_MIXERS = {"tiny": ("gla",), "default": ("mamba2", "gla", "kda", "kdn_diag")}
EVAL = {"tiny": {"documents": 16, "chunk": 2048}, "default": {"documents": 64, "chunk": 512}}
MAX_LEN = 8192
# the optional flags of study_driver.SHARED_FLAGS this study takes
DRIVER_FLAGS = "pretrain_steps post_steps chunk resamples fast_compile"


# this study's own flags; those every study takes: study_driver.define_flags below
FLAGS = flags.FlagValues()
flags.DEFINE_list(
  "mixers", [], "mixers (default: tiny gla; default mamba2,gla,kda,kdn_diag)", flag_values=FLAGS
)
flags.DEFINE_integer(
  "documents", 0, "evaluation documents (0: tiny 16, default 64)", flag_values=FLAGS
)
flags.DEFINE_integer("max_len", MAX_LEN, "evaluated positions per document", flag_values=FLAGS)
flags.DEFINE_bool(
  "all_checkpoints",
  None,
  "evaluate every kept pretraining checkpoint (default: on for the default preset, off for tiny)",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "plots",
  False,
  "copy each evaluation's PNG (excess NLL by position with its band) beside its JSON",
  flag_values=FLAGS,
)


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
    publish=False,
  ):
    study_driver.check_choice("--preset", preset, PRESETS)
    self.preset = preset
    self.mixers = tuple(mixers) or DEFAULT_MIXERS[preset]
    bad = [m for m in self.mixers if m not in schema.MIXERS]
    if bad:
      raise ValueError(f"--mixers: unknown {bad}; expected names from {list(schema.MIXERS)}")
    self.strategies = study_driver.check_strategies(strategies)
    study_driver.check_non_negative(
      pretrain_steps=pretrain_steps,
      post_steps=post_steps,
      documents=documents,
      chunk=chunk,
      deadline_s=deadline_s,
    )
    if max_len < 8192:
      raise ValueError(f"--max_len: the verdict reads positions [4096, 8192); got {max_len}")
    study_driver.check_resamples(resamples)
    self.workdir = workdir or f"/tmp/lengen_synthetic_{preset}"
    self.results = os.path.join(results or os.path.join(self.workdir, "results"), preset)
    base = study_config.get_config(preset)
    self.pretrain_steps = pretrain_steps or int(base.train.num_steps)
    self.post_steps = post_steps or max(1, round(self.pretrain_steps * study_config.POST_FRACTION))
    self.documents = documents or EVAL[preset]["documents"]
    if self.documents < 2:
      raise ValueError(f"--documents: the intervals need >= 2 documents, got {self.documents}")
    self.chunk = chunk or EVAL[preset]["chunk"]
    self.max_len, self.resamples = max_len, resamples
    self.all_checkpoints = preset == "default" if all_checkpoints is None else all_checkpoints
    self.deadline = study_driver.Deadline(deadline_s)
    self.fast_compile = preset == "tiny" if fast_compile is None else fast_compile
    self.plots = plots
    self.publish = publish
    self.overrides = study_driver.parse_overrides(overrides)
    # fails here, naming the key, rather than mid-study
    study_driver.apply_overrides(base, self.overrides)
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
    study_driver.apply_overrides(c, self.overrides)
    return c


# ------------------------------------------------------------------------------------------ work
def evaluated(plan, path, step) -> bool:
  """Whether the JSON at ``path`` is the evaluation of ``step`` with the plan's settings."""
  r = study_driver.read_json(path)
  return (
    bool(r)
    and r.get("step") == step
    and r["topic_floor"]["documents"] == plan.documents
    and r["topic_floor"]["length"] == plan.max_len
  )


def mixer_work(plan, mixer) -> list[tuple]:
  """(kind, stage, units) still to do for one mixer, in order; evaluation steps resolved when
  run."""
  pretrain_evals = 4 if plan.all_checkpoints else 1
  eval_units = plan.documents * plan.max_len * study_driver.EVAL_COST
  return study_driver.stage_work(plan, mixer, evaluated, pretrain_evals, eval_units)


def train_stage(plan, mixer, stage) -> dict | None:
  """Trains one run; only post-training compiles fast (pretraining's steps repay the compile)."""
  return study_driver.train(plan, mixer, stage, plan.fast_compile and stage != "pretrain")


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
  for k in ("meta", "bucket_model_nll", "bucket_floor_nll", "bucket_excess_per_document"):
    tf.pop(k, None)
  summary = study_driver.read_json(os.path.join(wd, "summary.json")) or {}
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
  path = write_json(study_driver.result_path(plan, mixer, stage, step), out)
  if plan.plots:
    shutil.copyfile(
      os.path.join(wd, "eval", f"step{step}", "topic_floor.png"), path[: -len(".json")] + ".png"
    )
  return out


def _record(workdir, step) -> dict:
  """The JSON record the trainer saved with a checkpoint (orbax's JsonSave file)."""
  path = os.path.join(workdir, "checkpoints", str(step), "record", "metadata")
  return study_driver.read_json(path) or {}


def evaluate_next(plan, mixer, stage) -> str | None:
  """Evaluates the next checkpoint of ``stage``; the meter's line, None when none is left."""
  step = study_driver.next_eval_step(
    plan, mixer, stage, evaluated, last_only=not plan.all_checkpoints
  )
  if step is None:
    return None
  tf = _evaluate(plan, mixer, stage, step)["topic_floor"]
  ratio = interval(tf["ppl_ratio"], 2)
  return f"{mixer} {stage} @ step {step} evaluated: PPL late / early {ratio}, {tf['verdict']}"


STUDY = study_driver.Study(
  module="experiments.studies.lengen_synthetic",
  unit="mixer",
  work=mixer_work,
  train=train_stage,
  evaluate=evaluate_next,
)


# ------------------------------------------------------------------------------------------ drivers
def run_in_process(plan) -> str:
  """The mixers one after another in this process; 'done' or 'deadline'."""
  return study_driver.run_in_process(STUDY, plan, plan.mixers)


def protocol(plan) -> str:
  """The study's settings in words, for commands.json."""
  c = plan.config(plan.mixers[0], "pretrain")
  return (
    f"preset {plan.preset}: {c.model.num_layers} layers, d={c.model.d_model}, "
    f"{c.model.num_heads} heads x {c.model.head_dim}; T={c.data.seq_len}, "
    f"batch {c.data.global_batch_size}; pretraining {plan.pretrain_steps} steps from the zero "
    f"state at lr {c.optim.learning_rate:g}, post-training {plan.post_steps} steps at lr "
    f"{study_config.POST_LR:g} (fresh optimizer); {source_line(c.data.topic)}; "
    f"evaluation: {plan.documents} documents x "
    f"{plan.max_len} positions, state carried in chunks of {plan.chunk}, {plan.resamples} "
    f"bootstrap resamples over documents"
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


def table(plan) -> str:
  return renderer.render_table(renderer.load_runs(plan.results))


# ------------------------------------------------------------------------------------------ command line
study_driver.define_flags(FLAGS, STUDY, PRESETS, STRATEGIES, DRIVER_FLAGS, preset_folder=True)


def main(argv):
  del argv
  return study_driver.main(STUDY, FLAGS, Plan, protocol=protocol, table=table)
