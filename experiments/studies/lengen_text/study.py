"""The length-generalisation study on text at a short context (configs/lengen_short.py): per arm,
pretrain from the zero state at T, evaluate every kept checkpoint (does extrapolation worsen with
more training tokens?), post-train with each initial-state strategy and evaluate those.

    # CPU, about a minute: every stage at tiny size on a generated toy corpus
    python -m experiments.studies.lengen_text --preset=tiny --toy_corpus
    # one GPU, the five arms side by side; resumable, stops cleanly at the deadline
    python -m experiments.studies.lengen_text --preset=t64 --parallel=5 --deadline_s=540 \\
        --workdir=/tmp/lengen_text --publish

Runs: ``<workdir>/<arm>/pretrain`` (``<preset>,<arm>``), then ``<workdir>/<arm>/<strategy>``
(``post`` / ``t128_post`` / ``tiny_post``, ``--config.train.init_from`` the pretrained run) for each
strategy; ``zero`` post-training is the control. Evaluation (``experiments.evaluation`` suites ppl,
position_ppl with its state_stats, effrem) starts from the normal initial state: position-wise PPL
to ``max_len`` (default 128 x T) over ``windows`` long-eval windows spread over the documents, the
state carried in chunks; the ratio PPL@max_len / PPL@T with a 95% bootstrap interval over the
windows; EffRem at 16 x T. One JSON per evaluation in ``<results>/<preset>/`` (default
``<workdir>/results``; ``--publish`` copies them into docs/results/lengen_text/)
(``<arm>.pretrain.step<k>.json``, ``<arm>.<strategy>.json``), rendered by
experiments/studies/lengen_text/render.py. A run or evaluation this plan completed is skipped; a
stopped run resumes from its checkpoint; a workdir made by another plan is refused (study_plan.py). ``--parallel=N`` runs up to N arms as separate processes (one
accelerator shared); their output is prefixed with the arm and kept in ``<workdir>/<arm>.log``.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import flags

from configs import lengen_short as study_config
from experiments import schema
from experiments.runner.logging_utils import write_json
from experiments.studies import study_driver, study_plan
from experiments.studies.lengen_text import render as renderer
from experiments.studies.results.common import interval

PRESETS = ("tiny", "t64", "t128")
POST_PRESET = {"tiny": "tiny_post", "t64": "post", "t128": "t128_post"}
STRATEGIES = ("zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
DEFAULT_ARMS = {
  "tiny": ("gla",),
  "t64": ("mamba2", "mamba2_long", "gla", "kda", "kdn_diag"),
  "t128": ("mamba2", "mamba2_long", "gla", "kda", "kdn_diag"),
}
# the evaluated long documents -> the suffix of the results folder (<preset><suffix>)
LONG_SPLITS = {"long_val": "_long_val", "long_eval": ""}
EVAL = {"tiny": {"windows": 8, "chunk": 512}, "t64": {"windows": 64, "chunk": 512}}
EVAL["t128"] = EVAL["t64"]
SUITES = ("ppl", "position_ppl", "effrem")
LONG_FACTOR = 128  # position_ppl to 128 x T
EFFREM_FACTOR = 16  # EffRem at T_eval = 16 x T
KEEP_FRACTIONS = (0.2, 0.5, 1.0)  # pretraining checkpoints kept and evaluated
# the optional flags of study_driver.SHARED_FLAGS this study takes
DRIVER_FLAGS = (
  "pretrain_steps post_steps corpus_dir toy_corpus windows chunk resamples seed fast_compile"
)


# this study's own flags; those every study takes: study_driver.define_flags below
FLAGS = flags.FlagValues()
flags.DEFINE_list(
  "arms",
  [],
  "arms (configs/lengen_short.py ARMS or mixer names; default: tiny gla; GPU "
  "mamba2,mamba2_long,gla,kda,kdn_diag)",
  flag_values=FLAGS,
)
flags.DEFINE_enum(
  "long_split",
  "long_val",
  ["long_val", "long_eval"],
  "the long documents evaluated: long_val (in-domain documents held out of train; prepare "
  "--long_val_docs) or long_eval (Shakespeare and Austen: sources outside the training domain)",
  flag_values=FLAGS,
)
flags.DEFINE_integer("max_len", 0, "evaluated positions (0: 128 x T)", flag_values=FLAGS)


# ------------------------------------------------------------------------------------------ plan
class Plan:
  """The study's settings after defaults, validated before any work."""

  def __init__(
    self,
    preset,
    arms=(),
    strategies=STRATEGIES,
    workdir="",
    results="",
    corpus_dir="",
    toy_corpus=False,
    pretrain_steps=0,
    post_steps=0,
    windows=0,
    chunk=0,
    max_len=0,
    resamples=2000,
    seed=0,
    deadline_s=0,
    overrides=(),
    fast_compile=None,
    long_split="long_val",
    publish=False,
  ):
    study_driver.check_choice("--preset", preset, PRESETS)
    self.preset = preset
    self.arms = tuple(arms) or DEFAULT_ARMS[preset]
    for arm in self.arms:
      try:
        study_config.arm_model_keys(arm)
      except schema.ConfigError:
        raise ValueError(
          f"--arms: unknown {arm!r}; expected {list(study_config.ARMS)} or mixer names"
        ) from None
    self.strategies = study_driver.check_strategies(strategies)
    study_driver.check_non_negative(
      pretrain_steps=pretrain_steps,
      post_steps=post_steps,
      windows=windows,
      chunk=chunk,
      max_len=max_len,
      deadline_s=deadline_s,
    )
    study_driver.check_resamples(resamples)
    study_driver.check_choice("--long_split", long_split, LONG_SPLITS)
    self.long_split = long_split
    self.publish = publish
    self.workdir = workdir or f"/tmp/lengen_text_{preset}"
    self.results = os.path.join(
      results or os.path.join(self.workdir, "results"), preset + LONG_SPLITS[long_split]
    )
    self.toy_corpus = toy_corpus
    self.corpus_dir = os.path.join(self.workdir, "toy_corpus") if toy_corpus else corpus_dir
    base = study_config.get_config(preset)
    self.train_len = int(base.data.seq_len)
    self.pretrain_steps = pretrain_steps or int(base.train.num_steps)
    self.post_steps = post_steps or max(1, round(self.pretrain_steps * study_config.POST_FRACTION))
    self.keep_steps = sorted({max(1, round(f * self.pretrain_steps)) for f in KEEP_FRACTIONS})
    self.windows = windows or EVAL[preset]["windows"]
    if self.windows < 2:
      raise ValueError(f"--windows: the intervals need >= 2 windows, got {self.windows}")
    self.max_len = max_len or LONG_FACTOR * self.train_len
    if self.max_len < 2 * self.train_len:
      raise ValueError(f"--max_len: must be >= 2 x T = {2 * self.train_len}, got {self.max_len}")
    self.chunk = min(chunk or EVAL[preset]["chunk"], self.max_len)
    self.effrem_len = min(EFFREM_FACTOR * self.train_len, self.max_len)
    self.resamples, self.seed = resamples, seed
    self.deadline = study_driver.Deadline(deadline_s)
    self.fast_compile = preset == "tiny" if fast_compile is None else fast_compile
    self.overrides = study_driver.parse_overrides(overrides)
    study_driver.apply_overrides(base, self.overrides)  # fails here, naming the key, not mid-study
    self.tokens_per_step = int(base.data.global_batch_size) * self.train_len
    self.long_path = os.path.join(self.corpus_dir or base.data.corpus_dir, f"{long_split}.npy")

  def check_long_split(self):
    """One line before any work when the corpus lacks the evaluated split."""
    if not os.path.exists(self.long_path):
      hint = (
        "prepare the corpus with --long_val_docs=64 (python -m experiments.data.prepare "
        "--out=<dir> --long_val_docs=64) or pass --long_split=long_eval"
        if self.long_split == "long_val"
        else "prepare the corpus (python -m experiments.data.prepare --out=<dir>)"
      )
      raise ValueError(f"--long_split={self.long_split}: {self.long_path} does not exist; {hint}")

  def run_dir(self, arm, stage):
    return os.path.join(self.workdir, arm, stage)

  def config(self, arm, stage):
    """The run config of ``stage`` ('pretrain' or a strategy)."""
    if stage == "pretrain":
      c = study_config.get_config(f"{self.preset},{arm}")
      steps = self.pretrain_steps
      c.checkpoint.keep_steps = ",".join(str(s) for s in self.keep_steps)
      c.checkpoint.every_steps = max(1, steps // 10)
      c.train.eval_every = self.keep_steps[0] if len(self.keep_steps) > 1 else 0
    else:
      c = study_config.get_config(f"{POST_PRESET[self.preset]},{arm},{stage}")
      steps = self.post_steps
      c.train.init_from = self.run_dir(arm, "pretrain")
      c.checkpoint.every_steps = steps
    c.train.num_steps = steps
    c.optim.warmup_steps = steps // 10
    if self.corpus_dir:
      c.data.corpus_dir = self.corpus_dir
    # the run checks the long documents it names: the split evaluated, not the corpus's long_eval
    c.data.long_eval_path = self.long_path
    if self.toy_corpus:
      c.model.vocab_size = TOY_VOCAB
    study_driver.apply_overrides(c, self.overrides)
    return c


# ------------------------------------------------------------------------------------------ toy data
TOY_VOCAB = 256
TOY_EOS = 0


def write_toy_corpus(out: str, seed: int = 0, long_len: int = 2100) -> str:
  """A corpus in prepare's layout (no tokenizer: the study's suites need none): documents drawn
  each from its own Zipf law over a random subset of the vocabulary, so the context identifies the
  document and a memory of it lowers the loss. Train 2000 short documents, val 200, long_eval and long_val 24
  each of ``long_len``+ tokens. Written once (a manifest present means done)."""
  if os.path.exists(os.path.join(out, "manifest.json")):
    return out
  os.makedirs(out, exist_ok=True)
  rng = np.random.default_rng(seed)
  ranks = 1.0 / np.arange(1, 49) ** 1.1
  ranks /= ranks.sum()

  def doc(n):
    words = rng.choice(np.arange(1, TOY_VOCAB), 48, replace=False)
    return np.append(words[rng.choice(48, n, p=ranks)], TOY_EOS).astype(np.int32)

  splits = {
    "train": [doc(int(n)) for n in rng.integers(20, 200, 2000)],
    "val": [doc(int(n)) for n in rng.integers(20, 200, 200)],
    "long_eval": [doc(int(n)) for n in rng.integers(long_len, long_len + 400, 24)],
    "long_val": [doc(int(n)) for n in rng.integers(long_len, long_len + 400, 24)],
  }
  for name, docs in splits.items():
    np.save(os.path.join(out, f"{name}.npy"), np.concatenate(docs))
    np.save(
      os.path.join(out, f"{name}.docs.npy"),
      np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
    )
  write_json(os.path.join(out, "manifest.json"), {"vocab_size": TOY_VOCAB, "eos_id": TOY_EOS})
  return out


# ------------------------------------------------------------------------------------------ work
def evaluated(plan, path, step) -> bool:
  """Whether the JSON at ``path`` is the evaluation of ``step`` with the plan's settings."""
  r = study_driver.read_json(path)
  return (
    bool(r)
    and r.get("step") == step
    and r["ratio"]["units"] == plan.windows
    and r["position"]["max_len"] == plan.max_len
    and r.get("long_split", "long_eval") == plan.long_split
  )


def arm_work(plan, arm) -> list[tuple]:
  """(kind, stage, units) still to do for one arm, in order (units: trained-token equivalents)."""
  eval_units = plan.windows * plan.max_len * study_driver.EVAL_COST
  return study_driver.stage_work(plan, arm, evaluated, len(plan.keep_steps), eval_units)


def train_stage(plan, arm, stage) -> dict | None:
  """Trains one run (compiled fast with --fast_compile, like the evaluations)."""
  return study_driver.train(plan, arm, stage, plan.fast_compile)


def _evaluate(plan, arm, stage, step) -> dict:
  from experiments.evaluation import runner  # pylint: disable=g-import-not-at-top  (imports jax)
  from experiments.evaluation.suites import Settings  # pylint: disable=g-import-not-at-top

  wd = plan.run_dir(arm, stage)
  settings = Settings(
    max_len=plan.max_len,
    chunk=plan.chunk,
    num_sequences=plan.windows,
    effrem_len=plan.effrem_len,
    effrem_sequences=min(plan.windows, 16),
    resamples=plan.resamples,
    seed=plan.seed,
    long_eval_path=plan.long_path,
  )
  t0 = time.time()
  with study_driver.lowest_optimisation(plan.fast_compile):
    res = runner.evaluate(wd, list(SUITES), settings, step, os.path.join(wd, "eval", f"step{step}"))
  pp, er, st = res["position_ppl"], res["effrem"], res["state_stats"]
  summary = study_driver.read_json(os.path.join(wd, "summary.json")) or {}
  init_step = summary.get("init_from_step")
  cfg = study_driver.read_json(os.path.join(wd, "config.json")) or {}
  model = cfg.get("model", {})
  out = {
    "study": "lengen_text",
    "preset": plan.preset,
    "arm": arm,
    "mixer": model.get("mixer"),
    "mamba2_variant": model.get("mamba2_variant"),
    "dt_range": [model.get("dt_min"), model.get("dt_max")],
    "stage": stage,
    "strategy": "zero" if stage == "pretrain" else stage,
    "post_trained": stage != "pretrain",
    "step": step,
    "init_from_step": init_step,
    "tokens": (step + (int(init_step) if init_step else 0)) * plan.tokens_per_step,
    "train_len": plan.train_len,
    "long_split": plan.long_split,
    "num_params": summary.get("num_params"),
    "val_ppl": res["ppl"]["perplexity"],
    "ratio": pp["ratio"],
    "position": {
      k: pp[k] for k in ("max_len", "chunk", "sequences", "bucket_center", "bucket_ppl", "ppl_at")
    }
    | {"bucket_ppl_lo": pp["bucket_ppl_lo"], "bucket_ppl_hi": pp["bucket_ppl_hi"]},
    "effrem": {k: er[k] for k in ("T", "t", "mean", "sequences")},
    "state_norm": {
      "t": [p["t"] for p in st["series"]],
      "memory_norm": [
        [None if lay is None else lay["memory_norm"] for lay in p["layers"]] for p in st["series"]
      ],
    },
    "train_wall_s": summary.get("wall_time_s"),
    "eval_wall_s": time.time() - t0,
  }
  write_json(study_driver.result_path(plan, arm, stage, step), out)
  return out


def evaluate_next(plan, arm, stage) -> str | None:
  """Evaluates the next checkpoint of ``stage``; the meter's line, None when none is left."""
  step = study_driver.next_eval_step(plan, arm, stage, evaluated)
  if step is None:
    return None
  r = _evaluate(plan, arm, stage, step)
  iv = r["ratio"]
  return (
    f"{arm} {stage} @ step {step} evaluated: val PPL {r['val_ppl']:.2f}, "
    f"PPL@{iv['long_len']} / PPL@{iv['train_len']} {interval(iv)}"
  )


STUDY = study_driver.Study(
  module="experiments.studies.lengen_text",
  unit="arm",
  work=arm_work,
  train=train_stage,
  evaluate=evaluate_next,
)


# ------------------------------------------------------------------------------------------ drivers
def prepare_inputs(plan):
  """The toy corpus written (when asked for), and the evaluated long split there."""
  study_plan.check_outside_repo(plan)  # before the toy corpus is written into the workdir
  if plan.toy_corpus:
    write_toy_corpus(plan.corpus_dir, long_len=plan.max_len + 1)
  plan.check_long_split()


def run_in_process(plan) -> str:
  """The arms one after another in this process; 'done' or 'deadline'."""
  prepare_inputs(plan)
  return study_driver.run_in_process(STUDY, plan, plan.arms)


def protocol(plan) -> str:
  """The study's settings in words, for commands.json."""
  c = plan.config(plan.arms[0], "pretrain")
  return (
    f"preset {plan.preset}: {c.model.num_layers} layers, d={c.model.d_model}, "
    f"{c.model.num_heads} heads x {c.model.head_dim}, vocabulary {c.model.vocab_size}; "
    f"T={plan.train_len}, batch {c.data.global_batch_size}; pretraining {plan.pretrain_steps} steps "
    f"from the zero state at lr {c.optim.learning_rate:g} (checkpoints {plan.keep_steps} "
    f"evaluated), post-training {plan.post_steps} steps at lr {study_config.POST_LR:g} (fresh "
    f"optimizer); corpus {c.data.corpus_dir}; evaluation: {plan.windows} {plan.long_split} windows of "
    f"{plan.max_len} tokens spread over the documents (seed {plan.seed}), state carried in chunks "
    f"of {plan.chunk}, EffRem at T={plan.effrem_len}, {plan.resamples} bootstrap resamples over "
    f"windows"
  )


def table(plan) -> str:
  runs = renderer.load_runs(plan.results)
  return renderer.render_table(runs) + "\n\n" + "\n".join(renderer.verdicts(runs))


# ------------------------------------------------------------------------------------------ command line
study_driver.define_flags(FLAGS, STUDY, PRESETS, STRATEGIES, DRIVER_FLAGS, preset_folder=True)


def main(argv):
  del argv
  # the toy corpus is written before any child starts: they would race to write it
  return study_driver.main(
    STUDY, FLAGS, Plan, protocol=protocol, table=table, prepare=prepare_inputs
  )
