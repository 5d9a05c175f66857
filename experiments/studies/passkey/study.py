"""The passkey study (configs/passkey.py): does a readout past the training length break from the
zero state, and does training from realistic states repair it? Per mixer and seed: pretrain at
T=128 from the zero state, post-train from that checkpoint with each initial-state strategy (``zero``
is the control), and score every run from the zero state on one fixed set of passkey examples
(length x depth), per example, so that runs are compared pairwise.

    # CPU, a few minutes: one mixer, two seeds, a short grid
    python -m experiments.studies.passkey --preset=tiny
    # one GPU: four mixers x three seeds as separate processes; resumable, stops at the deadline
    python -m experiments.studies.passkey --preset=cpu --parallel=12 --deadline_s=540 \\
        --workdir=/tmp/passkey --results=/tmp/passkey_results

Arms are ``<mixer>.s<seed>``: the seed sets the initial parameters and the data order
(``config.seed`` and ``data.shuffle_seed``); post-training keeps it. Runs:
``<workdir>/<mixer>/s<seed>/pretrain`` and ``.../<strategy>`` (``--config.train.init_from`` the
pretrained run, a fresh optimizer at ``--post_lr_scale`` x the pretraining peak rate). Evaluation
examples are drawn from ``--eval_seed`` alone (``retrieval.grid``), never from the run, and their
hash is stored with every result: two results are paired only when the hashes agree.
Each evaluation writes ``<results>/<arm>.<stage>[.step<k>].json`` with, per (length, depth) cell,
every example's exact match and correct-digit count; experiments/studies/passkey/render.py turns
them into intervals over seeds x examples and verdicts.
"""

from __future__ import annotations

import hashlib
import os
import time

from absl import flags

from configs import passkey as study_config
from experiments import schema
from experiments.runner.logging_utils import write_json
from experiments.studies import study_driver

PRESETS = ("tiny", "cpu")
STRATEGIES = ("zero", "state_passing", "tbtt", "fitted_noise")
DEFAULT_MIXERS = {"tiny": ("gla",), "cpu": ("gla", "kdn_diag", "kda", "mamba2")}
DEFAULT_SEEDS = {"tiny": "0,1", "cpu": "0,1,2"}
LENGTHS = {"tiny": (128, 512), "cpu": (128, 256, 512, 1024, 2048, 4096, 8192, 16384)}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
EXAMPLES = {"tiny": 16, "cpu": 256}
PRETRAIN_STEPS = {"tiny": 60, "cpu": 1000}
POST_STEPS = {"tiny": 20, "cpu": 300}
# the optional flags of study_driver.SHARED_FLAGS this study takes
DRIVER_FLAGS = "pretrain_steps post_steps post_lr_scale"

# this study's own flags; those every study takes: study_driver.define_flags below
FLAGS = flags.FlagValues()
flags.DEFINE_list(
  "mixers", [], "mixers (default: tiny gla; cpu gla,kdn_diag,kda,mamba2)", flag_values=FLAGS
)
flags.DEFINE_string("seeds", "", "seeds (default: tiny 0,1; cpu 0,1,2)", flag_values=FLAGS)
flags.DEFINE_list("arms", [], "<mixer>.s<seed> arms (default: mixers x seeds)", flag_values=FLAGS)
flags.DEFINE_list("lengths", [], "evaluated lengths (default: the preset's)", flag_values=FLAGS)
flags.DEFINE_list(
  "depths", [str(d) for d in DEPTHS], "evaluated depths in [0, 1]", flag_values=FLAGS
)
flags.DEFINE_integer(
  "examples", 0, "examples per (length, depth) cell (0: the preset's)", flag_values=FLAGS
)
flags.DEFINE_integer("eval_seed", 1234, "the seed of the evaluation examples", flag_values=FLAGS)
flags.DEFINE_integer("batch", 32, "rows per evaluation forward", flag_values=FLAGS)


# ------------------------------------------------------------------------------------------ plan
# arm names beyond the registry's mixers: a mixer with model settings of its own
VARIANTS = {
  "mamba2_official": ("mamba2", {"model.mamba2_variant": "official"}),
}


def arm_mixers() -> list[str]:
  return list(schema.MIXERS) + list(VARIANTS)


def parse_arm(arm: str) -> tuple[str, int]:
  mixer, sep, seed = arm.rpartition(".s")
  if not sep or not seed.isdigit() or mixer not in arm_mixers():
    raise ValueError(
      f"--arms: expected <mixer>.s<seed> with a mixer from {arm_mixers()}, got {arm!r}"
    )
  return mixer, int(seed)


class Plan:
  """The study's settings after defaults, validated before any work."""

  def __init__(
    self,
    preset="tiny",
    mixers=(),
    seeds="",
    arms=(),
    strategies=STRATEGIES,
    workdir="",
    results="",
    pretrain_steps=0,
    post_steps=0,
    post_lr_scale=0.1,
    lengths=(),
    depths=DEPTHS,
    examples=0,
    eval_seed=1234,
    batch=32,
    deadline_s=0,
    overrides=(),
    publish=False,
  ):
    study_driver.check_choice("--preset", preset, PRESETS)
    self.preset = preset
    mixers = tuple(mixers) or DEFAULT_MIXERS[preset]
    seeds = schema.parse_seeds(seeds or DEFAULT_SEEDS[preset])
    self.arms = tuple(arms) or tuple(f"{m}.s{s}" for m in mixers for s in seeds)
    for a in self.arms:
      parse_arm(a)
    self.strategies = study_driver.check_strategies(strategies)
    study_driver.check_non_negative(
      pretrain_steps=pretrain_steps, post_steps=post_steps, examples=examples, deadline_s=deadline_s
    )
    if not 0 < post_lr_scale <= 1:
      raise ValueError(f"--post_lr_scale: expected a value in (0, 1], got {post_lr_scale}")
    self.lengths = tuple(int(x) for x in lengths) or LENGTHS[preset]
    self.depths = tuple(float(d) for d in depths)
    if any(not 0 <= d <= 1 for d in self.depths):
      raise ValueError(f"--depths: expected fractions in [0, 1], got {list(self.depths)}")
    self.examples = examples or EXAMPLES[preset]
    if batch < 1:
      raise ValueError(f"--batch: must be positive, got {batch}")
    self.eval_seed, self.batch = eval_seed, batch
    self.workdir = workdir or f"/tmp/kdn_passkey_{preset}"
    self.results = results or os.path.join(self.workdir, "results", preset)
    self.pretrain_steps = pretrain_steps or PRETRAIN_STEPS[preset]
    self.post_steps = post_steps or POST_STEPS[preset]
    self.post_lr_scale = post_lr_scale
    self.publish = publish
    self.deadline = study_driver.Deadline(deadline_s)
    self.overrides = study_driver.parse_overrides(overrides)
    base = self.config(self.arms[0], "pretrain")  # fails here, naming the key
    train_len = int(base.data.seq_len)
    if min(self.lengths) < 2 * int(base.data.passkey.digits) + 2:
      raise ValueError(f"--lengths: {min(self.lengths)} is too short for a passkey")
    self.train_len = train_len
    self.tokens_per_step = int(base.data.global_batch_size) * train_len

  def run_dir(self, arm, stage):
    mixer, seed = parse_arm(arm)
    return os.path.join(self.workdir, mixer, f"s{seed}", stage)

  def config(self, arm, stage):
    """The run config of ``stage`` ('pretrain' or a strategy) of ``arm``."""
    mixer, seed = parse_arm(arm)
    base_mixer, settings = VARIANTS.get(mixer, (mixer, {}))
    c = study_config.get_config(f"cpu,{base_mixer}")
    study_driver.apply_overrides(c, settings)
    peak = float(c.optim.learning_rate)
    if stage == "pretrain":
      steps = self.pretrain_steps
    else:
      c.train.initial_state = stage
      c.train.init_from = self.run_dir(arm, "pretrain")
      c.optim.learning_rate = peak * self.post_lr_scale
      steps = self.post_steps
    c.seed = c.data.shuffle_seed = seed
    c.train.num_steps = steps
    c.optim.warmup_steps = max(1, min(int(c.optim.warmup_steps), steps // 10))
    c.checkpoint.every_steps = steps
    c.train.eval_every = steps
    c.logging.plot = c.logging.tensorboard = False
    if self.preset == "tiny":
      c.data.num_eval_examples = c.data.eval_batch_size = 16
      c.train.eval_batches = 1
    study_driver.apply_overrides(c, self.overrides)
    return c


# ------------------------------------------------------------------------------------------ eval
def eval_cells(plan):
  """The evaluation examples: ``retrieval.grid`` cells (lengths outer, depths inner) and their
  hash. Drawn from ``plan.eval_seed`` alone: every run is scored on the same examples."""
  from experiments.data import retrieval  # pylint: disable=g-import-not-at-top

  c = plan.config(plan.arms[0], "pretrain")
  cells = retrieval.grid(
    "passkey",
    plan.lengths,
    plan.depths,
    plan.examples,
    plan.eval_seed,
    vocab_size=int(c.data.passkey.vocab_size),
    digits=int(c.data.passkey.digits),
  )
  h = hashlib.sha256()
  for cell in cells:
    for k in ("inputs", "targets", "mask"):
      h.update(cell["examples"][k].tobytes())
  return cells, h.hexdigest()[:16]


def evaluated(plan, path, step) -> bool:
  """Whether the JSON at ``path`` scores ``step`` on this plan's evaluation set."""
  r = study_driver.read_json(path)
  return (
    bool(r)
    and r.get("step") == step
    and r.get("eval", {}).get("lengths") == list(plan.lengths)
    and r["eval"].get("depths") == list(plan.depths)
    and r["eval"].get("examples") == plan.examples
    and r["eval"].get("seed") == plan.eval_seed
  )


def arm_work(plan, arm) -> list[tuple]:
  units = plan.examples * len(plan.depths) * sum(plan.lengths) * study_driver.EVAL_COST
  return study_driver.stage_work(plan, arm, evaluated, 1, units)


def train_stage(plan, arm, stage) -> dict | None:
  return study_driver.train(plan, arm, stage, fast_compile=False)


def score_run(plan, workdir, step) -> dict:
  """Per cell, every example's exact match and correct digits, scored from the zero state."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from experiments import loading  # pylint: disable=g-import-not-at-top
  from experiments.evaluation import long_context  # pylint: disable=g-import-not-at-top

  cells, digest = eval_cells(plan)
  run = loading.load(workdir, step)
  scorer = long_context.ChunkedScorer(run.model)
  out = []
  for cell in cells:
    ex = cell["examples"]
    right = []
    for s in range(0, len(ex["inputs"]), plan.batch):
      _, c = scorer.one_shot(ex["inputs"][s : s + plan.batch], ex["targets"][s : s + plan.batch])
      right.append(np.asarray(c, bool))
    right = np.concatenate(right)
    m = ex["mask"] > 0
    digits = np.sum(right & m, axis=1)
    exact = digits == m.sum(axis=1)
    out.append(
      {
        "length": cell["length"],
        "depth": cell["depth"],
        "exact": "".join("1" if e else "0" for e in exact),
        "digits": "".join(str(int(d)) for d in digits),
        "exact_match": float(exact.mean()),
        "digit_accuracy": float(digits.sum() / m.sum()),
      }
    )
  return {"cells": out, "hash": digest, "digits_per_example": int(m.sum(axis=1)[0])}


def evaluate_next(plan, arm, stage) -> str | None:
  step = study_driver.next_eval_step(plan, arm, stage, evaluated, last_only=True)
  if step is None:
    return None
  wd = plan.run_dir(arm, stage)
  t0 = time.time()
  scored = score_run(plan, wd, step)
  summary = study_driver.read_json(os.path.join(wd, "summary.json")) or {}
  mixer, seed = parse_arm(arm)
  out = {
    "study": "passkey",
    "preset": plan.preset,
    "mixer": mixer,
    "seed": seed,
    "stage": stage,
    "strategy": "zero" if stage == "pretrain" else stage,
    "post_trained": stage != "pretrain",
    "step": step,
    "pretrain_steps": plan.pretrain_steps,
    "post_steps": plan.post_steps if stage != "pretrain" else 0,
    "train_len": plan.train_len,
    "num_params": summary.get("num_params"),
    "train_wall_s": summary.get("wall_time_s"),
    "eval_wall_s": round(time.time() - t0, 1),
    "eval": {
      "lengths": list(plan.lengths),
      "depths": list(plan.depths),
      "examples": plan.examples,
      "seed": plan.eval_seed,
      "hash": scored["hash"],
      "digits_per_example": scored["digits_per_example"],
    },
    "cells": scored["cells"],
  }
  write_json(study_driver.result_path(plan, arm, stage, step), out)
  last = [
    c for c in out["cells"] if c["length"] == max(plan.lengths) and c["depth"] == max(plan.depths)
  ]
  return (
    f"{arm} {stage} @ step {step} evaluated: exact match at length {max(plan.lengths)}, depth "
    f"{max(plan.depths):g}: {last[0]['exact_match']:.3f}"
  )


STUDY = study_driver.Study(
  module="experiments.studies.passkey",
  unit="arm",
  work=arm_work,
  train=train_stage,
  evaluate=evaluate_next,
)


def protocol(plan) -> str:
  c = plan.config(plan.arms[0], "pretrain")
  return (
    f"preset {plan.preset}: {c.model.num_layers} layers, d={c.model.d_model}, "
    f"{c.model.num_heads} heads x {c.model.head_dim}; passkey of {c.data.passkey.digits} digits, "
    f"vocabulary {c.data.passkey.vocab_size}; T={c.data.seq_len}, batch "
    f"{c.data.global_batch_size}; pretraining {plan.pretrain_steps} steps from the zero state at "
    f"lr {c.optim.learning_rate:g}; post-training {plan.post_steps} steps at "
    f"{plan.post_lr_scale:g}x that rate (fresh optimizer) with each initial state; seeds set the "
    f"initial parameters and data order. Evaluation from the zero state: lengths "
    f"{', '.join(map(str, plan.lengths))} x depths {', '.join(f'{d:g}' for d in plan.depths)}, "
    f"{plan.examples} examples per cell drawn from seed {plan.eval_seed} (the same for every run)"
  )


# ------------------------------------------------------------------------------------------ command line
def table(plan) -> str:
  from experiments.studies.passkey import render as renderer  # pylint: disable=g-import-not-at-top

  return renderer.render_tables(renderer.load_runs(plan.results))


study_driver.define_flags(FLAGS, STUDY, PRESETS, STRATEGIES, DRIVER_FLAGS)


def main(argv):
  del argv
  return study_driver.main(STUDY, FLAGS, Plan, protocol=protocol, table=table)
