"""The copying study (configs/copying.py, the ``<size>,<arm>,l<max>`` runs): copy strings of
L ~ U[50, 100] over 29 symbols learnt from scratch, then scored at L up to 400. Does the loss past
the training range come from the zero initial state (state passing, during or after training,
repairs it) or from capacity (a model trained on L ~ U[50, 300] fails there too)?

    # CPU, well under a minute: one tiny cell, its post-trainings and the evaluation
    python -m experiments.studies.copying --preset=tiny
    # one GPU: tokens/s of each (arm, size, range) first, to choose the sizes that fit a stretch
    python -m experiments.studies.copying --preset=gpu --measure_throughput --workdir=/tmp/copying
    # then the study, several cells at a time; resumable: the same command again goes on from the
    # checkpoints (a 540 s deadline leaves a 600 s command time to save and write the table);
    # results in <workdir>/results/gpu, copied out after each call
    python -m experiments.studies.copying --preset=gpu --sizes=5m --parallel=6 --deadline_s=540 \\
        --workdir=/tmp/copying; cp -r /tmp/copying/results/gpu $OUT/copying_gpu

Cells are ``<arm>.<size>.<train>.s<seed>``: arm ``mamba2`` (mamba_ssm's Mamba-2 LM) or ``kdn_diag``
at the same non-embedding count (``configs/copying.py:non_embedding``); sizes ``tiny`` (CPU), 5m,
15m, 45m; train ``zero`` (zero initial state, L ~ U[50, 100]), ``sp`` (state passing during
training, each row reset with probability ``train.state_reset_prob`` = 0.1) or ``cap`` (the capacity
control: zero state, L ~ U[50, 300]). Every cell trains on ``--sequences`` sequences (steps x
batch); a ``zero`` cell is then post-trained for ``--post_fraction`` of its steps at
``--post_lr_scale`` x the peak rate with a fresh optimizer, once per ``--strategies`` (``zero``:
the control for the extra steps; ``state_passing``). The seed sets the initial parameters and the
data order. Order: sizes ascending, then train (zero, sp, cap), seed, arm: a stopped study has
whole comparisons of the smaller models.

Evaluation from the zero state on ``--examples`` strings per copy length in ``--lengths``, drawn
from ``--eval_seed`` alone (the same strings for every run; their hash in every result):
teacher-forced (argmax at each copied position given the true prefix) and free-running (greedy
decode of L symbols after ``BOS x SEP``, ``kdn_jax/models/generate.py``); per example the correct
characters of both (space-separated counts), so that intervals over seeds x examples can be computed
(experiments/studies/copying/render.py). Results: ``<results>/<cell>.pretrain.step<k>.json`` and
``<results>/<cell>.<strategy>.json``.

Resumable: a result this plan wrote is skipped, a stopped run resumes from its checkpoint, a
workdir of another plan is refused (study_plan.py). On a machine that loses its disk between
stretches carry the results folder back: finished cells are skipped, an unfinished one trains again.

``--measure_throughput`` trains each distinct (arm, size, range) of the plan a few steps alone and
writes ``<results>/throughput.json``: steady tokens/s and the minutes each cell's runs take.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time

import numpy as np
from absl import flags

from configs import copying as study_config
from experiments import schema
from experiments.runner.logging_utils import fmt_time, write_json
from experiments.studies import study_driver

PRESETS = ("tiny", "gpu")
# train arm -> (longest training copy, initial state during training)
TRAINS = {"zero": (100, "zero"), "sp": (100, "state_passing"), "cap": (300, "zero")}
STRATEGIES = ("zero", "state_passing")
DEFAULTS = {
  "tiny": dict(
    arms=("mamba2",),
    sizes=("tiny",),
    trains=("zero",),
    seeds="0",
    sequences=32,
    lengths=(50, 120),
    examples=4,
    batch=4,
  ),
  "gpu": dict(
    arms=tuple(study_config.ARMS),
    sizes=("5m", "15m", "45m"),
    trains=tuple(TRAINS),
    seeds="0,1,2",
    sequences=1_000_000,
    lengths=(50, 100, 150, 200, 300, 400),
    examples=512,
    batch=128,
  ),
}
WARMUP_FRACTION = 0.05
THROUGHPUT_STEPS = 40  # steps per shape measured (the first logged interval holds the compile)

DRIVER_FLAGS = "post_lr_scale"

# this study's own flags; those every study takes: study_driver.define_flags below
FLAGS = flags.FlagValues()
flags.DEFINE_list("arms", [], "arms (mamba2, kdn_diag; default: the preset's)", flag_values=FLAGS)
flags.DEFINE_list("sizes", [], "sizes (tiny, 5m, 15m, 45m)", flag_values=FLAGS)
flags.DEFINE_list("trains", [], "training arms (zero, sp, cap)", flag_values=FLAGS)
flags.DEFINE_string("seeds", "", "seeds (default gpu: 0,1,2)", flag_values=FLAGS)
flags.DEFINE_list(
  "cells", [], "<arm>.<size>.<train>.s<seed> cells (default: every combination)", flag_values=FLAGS
)
flags.DEFINE_integer(
  "sequences", 0, "training sequences per cell (0: the preset's)", flag_values=FLAGS
)
flags.DEFINE_float("post_fraction", 0.1, "post-training steps / training", flag_values=FLAGS)
flags.DEFINE_list(
  "lengths", [], "evaluated copy lengths (default: the preset's)", flag_values=FLAGS
)
flags.DEFINE_integer("examples", 0, "strings per length (0: the preset's)", flag_values=FLAGS)
flags.DEFINE_integer("eval_seed", 1234, "the seed of the evaluation strings", flag_values=FLAGS)
flags.DEFINE_integer("batch", 0, "rows per evaluation forward (0: the preset's)", flag_values=FLAGS)
flags.DEFINE_bool(
  "measure_throughput", False, "time each cell shape a few steps; no study", flag_values=FLAGS
)


# ------------------------------------------------------------------------------------------ cells
def parse_cell(cell: str) -> tuple[str, str, str, int]:
  """'<arm>.<size>.<train>.s<seed>' -> (arm, size, train, seed)."""
  parts = cell.split(".")
  ok = (
    len(parts) == 4
    and parts[0] in study_config.ARMS
    and parts[1] in study_config.SIZES
    and parts[2] in TRAINS
    and parts[3][:1] == "s"
    and parts[3][1:].isdigit()
  )
  if not ok:
    raise ValueError(
      f"--cells: expected <arm>.<size>.<train>.s<seed> with arm in {list(study_config.ARMS)}, "
      f"size in {list(study_config.SIZES)}, train in {list(TRAINS)}, got {cell!r}"
    )
  return parts[0], parts[1], parts[2], int(parts[3][1:])


def order_key(cell: str) -> tuple:
  arm, size, train, seed = parse_cell(cell)
  return (
    list(study_config.SIZES).index(size),
    list(TRAINS).index(train),
    seed,
    list(study_config.ARMS).index(arm),
  )


def _check_names(flag: str, names, known):
  bad = [n for n in names if n not in known]
  if bad:
    raise ValueError(f"--{flag}: unknown {bad}; expected names from {list(known)}")


class Plan:
  """The study's settings after defaults, validated before any work."""

  def __init__(
    self,
    preset="tiny",
    arms=(),
    sizes=(),
    trains=(),
    seeds="",
    cells=(),
    strategies=STRATEGIES,
    sequences=0,
    post_fraction=0.1,
    post_lr_scale=0.1,
    lengths=(),
    examples=0,
    eval_seed=1234,
    batch=0,
    workdir="",
    results="",
    deadline_s=0,
    overrides=(),
    publish=False,
  ):
    study_driver.check_choice("--preset", preset, PRESETS)
    d = DEFAULTS[preset]
    self.preset = preset
    arms, sizes, trains = tuple(arms) or d["arms"], tuple(sizes) or d["sizes"], tuple(trains)
    trains = trains or d["trains"]
    _check_names("arms", arms, study_config.ARMS)
    _check_names("sizes", sizes, study_config.SIZES)
    _check_names("trains", trains, TRAINS)
    seeds = schema.parse_seeds(seeds or d["seeds"])
    cells = tuple(cells) or tuple(
      f"{a}.{z}.{t}.s{s}" for a in arms for z in sizes for t in trains for s in seeds
    )
    for c in cells:
      parse_cell(c)
    self.cells = tuple(sorted(cells, key=order_key))
    self.strategies = study_driver.check_strategies(strategies)
    study_driver.check_non_negative(
      sequences=sequences, examples=examples, batch=batch, deadline_s=deadline_s
    )
    if not 0 < post_fraction <= 1:
      raise ValueError(f"--post_fraction: expected a value in (0, 1], got {post_fraction}")
    if not 0 < post_lr_scale <= 1:
      raise ValueError(f"--post_lr_scale: expected a value in (0, 1], got {post_lr_scale}")
    self.sequences = sequences or d["sequences"]
    self.post_fraction, self.post_lr_scale = post_fraction, post_lr_scale
    self.lengths = tuple(int(x) for x in lengths) or d["lengths"]
    if any(n < 1 for n in self.lengths):
      raise ValueError(f"--lengths: expected positive copy lengths, got {list(self.lengths)}")
    self.examples = examples or d["examples"]
    self.eval_seed = eval_seed
    self.batch = batch or d["batch"]
    self.workdir = workdir or f"/tmp/kdn_copying_{preset}"
    self.results = results or os.path.join(self.workdir, "results", preset)
    self.publish = publish
    self.deadline = study_driver.Deadline(deadline_s)
    self.overrides = study_driver.parse_overrides(overrides)
    self.fast_compile = preset == "tiny"  # CPU: XLA's lowest optimisation compiles in seconds
    for c in self.cells:
      self.config(c, "pretrain")  # a bad override fails here, naming the key

  def _base(self, cell, stage="zero"):
    arm, size, train, _ = parse_cell(cell)
    top, initial = TRAINS[train]
    c = study_config.get_config(f"{size},{arm},l{top},{initial if stage == 'pretrain' else stage}")
    study_driver.apply_overrides(c, self.overrides)
    return c

  def tokens_per_step(self, cell) -> int:
    c = self._base(cell)
    return int(c.data.global_batch_size) * int(c.data.seq_len)

  def steps(self, cell, stage) -> int:
    pre = max(1, math.ceil(self.sequences / int(self._base(cell).data.global_batch_size)))
    return pre if stage == "pretrain" else max(1, round(self.post_fraction * pre))

  def post_strategies(self, cell) -> tuple[str, ...]:
    """The post-trainings of ``cell``: the zero-state cells' only."""
    return self.strategies if parse_cell(cell)[2] == "zero" else ()

  def run_dir(self, cell, stage):
    return os.path.join(self.workdir, cell, stage)

  def config(self, cell, stage):
    """The run config of ``stage`` ('pretrain' or a post-training strategy) of ``cell``."""
    seed = parse_cell(cell)[3]
    c = self._base(cell, stage)
    steps = self.steps(cell, stage)
    if stage != "pretrain":
      c.train.init_from = self.run_dir(cell, "pretrain")
      c.optim.learning_rate = float(c.optim.learning_rate) * self.post_lr_scale
    c.seed = c.data.shuffle_seed = seed
    c.train.num_steps = steps
    c.train.eval_every = 0
    c.optim.warmup_steps = max(1, round(WARMUP_FRACTION * steps))
    c.checkpoint.every_steps = max(1, steps // 4)  # resumable; keep=1 leaves the last
    study_driver.apply_overrides(c, self.overrides)
    return c


# ------------------------------------------------------------------------------------------ eval
@functools.lru_cache(maxsize=4)
def eval_strings(lengths: tuple, examples: int, seed: int) -> tuple[list, str]:
  """[(L, examples of ``BOS x SEP x`` at T = 2L + 1)] and their hash, from ``seed`` alone: every
  run is scored on the same strings."""
  from experiments.data import retrieval  # pylint: disable=g-import-not-at-top

  sets, h = [], hashlib.sha256()
  for n in lengths:
    (cell,) = retrieval.grid(
      "copy", [2 * n + 1], [n], examples, seed, vocab_size=study_config.VOCAB
    )
    ex = cell["examples"]
    for k in ("inputs", "targets", "mask"):
      h.update(ex[k].tobytes())
    sets.append((n, ex))
  return sets, h.hexdigest()[:16]


def _padded(x, rows: int):
  """``x`` with its last row repeated up to ``rows`` rows (one compiled shape per length)."""
  return np.concatenate([x, np.repeat(x[-1:], rows - len(x), axis=0)]) if len(x) < rows else x


def score_run(plan, workdir: str, step: int) -> tuple[list, str]:
  """Per copy length, every string's correct characters teacher-forced and free-running."""
  from experiments import loading  # pylint: disable=g-import-not-at-top  (imports jax)
  from experiments.evaluation import long_context  # pylint: disable=g-import-not-at-top
  from kdn_jax.models.generate import generate  # pylint: disable=g-import-not-at-top

  sets, digest = eval_strings(plan.lengths, plan.examples, plan.eval_seed)
  run = loading.load(workdir, step)
  scorer = long_context.ChunkedScorer(run.model)
  cells = []
  for n, ex in sets:
    tf, fr = [], []
    for s in range(0, len(ex["inputs"]), plan.batch):
      rows = len(ex["inputs"][s : s + plan.batch])
      inputs = _padded(ex["inputs"][s : s + plan.batch], plan.batch)
      targets = _padded(ex["targets"][s : s + plan.batch], plan.batch)
      scored = _padded(ex["mask"][s : s + plan.batch], plan.batch) > 0
      _, right = scorer.one_shot(inputs, targets)
      tf.append(np.sum(np.asarray(right) & scored, axis=1)[:rows])
      out = np.asarray(generate(run.model, inputs[:, : n + 2], n))
      fr.append(np.sum(out[:, n + 2 :] == inputs[:, 1 : n + 1], axis=1)[:rows])
    tf, fr = np.concatenate(tf), np.concatenate(fr)
    cells.append(
      {
        "copy_len": n,
        # space-separated counts: a JSON list would take a line per string
        "teacher_forced": " ".join(str(int(v)) for v in tf),
        "free_running": " ".join(str(int(v)) for v in fr),
        "char_acc_tf": float(tf.mean() / n),
        "exact_tf": float(np.mean(tf == n)),
        "char_acc_fr": float(fr.mean() / n),
        "exact_fr": float(np.mean(fr == n)),
      }
    )
  return cells, digest


def evaluated(plan, path, step) -> bool:
  """Whether the JSON at ``path`` scores ``step`` on this plan's evaluation strings."""
  r = study_driver.read_json(path)
  e = (r or {}).get("eval", {})
  return (
    bool(r)
    and r.get("step") == step
    and e.get("lengths") == list(plan.lengths)
    and e.get("examples") == plan.examples
    and e.get("seed") == plan.eval_seed
  )


def _result(plan, cell, stage) -> str:
  step = plan.steps(cell, stage) if stage == "pretrain" else None
  return study_driver.result_path(plan, cell, stage, step)


def _done(plan, cell, stage) -> bool:
  return study_driver.done(
    plan, cell, evaluated, _result(plan, cell, stage), plan.steps(cell, stage)
  )


def cell_work(plan, cell) -> list[tuple]:
  """(kind, stage, units) still to do: the training (when its evaluation or a post-training
  without a checkpoint of its own needs it), its evaluation, then each post-training and its
  evaluation."""
  tps = plan.tokens_per_step(cell)
  eval_units = plan.examples * sum(2 * n + 1 for n in plan.lengths) * 2 * study_driver.EVAL_COST
  post = [s for s in plan.post_strategies(cell) if not _done(plan, cell, s)]
  pre_eval = not _done(plan, cell, "pretrain")
  steps = plan.steps(cell, "pretrain")
  need_pre = pre_eval or any(not study_driver.checkpoint_steps(plan.run_dir(cell, s)) for s in post)
  work = []
  if need_pre and not study_driver.trained(plan.run_dir(cell, "pretrain"), steps):
    work.append(("train", "pretrain", steps * tps))
  if pre_eval:
    work.append(("eval", "pretrain", eval_units))
  for s in post:
    if not study_driver.trained(plan.run_dir(cell, s), plan.steps(cell, s)):
      work.append(("train", s, plan.steps(cell, s) * tps))
    work.append(("eval", s, eval_units))
  return work


def train_stage(plan, cell, stage) -> dict | None:
  return study_driver.train(plan, cell, stage, plan.fast_compile)


def evaluate_next(plan, cell, stage) -> str | None:
  """Scores the stage's last checkpoint unless done; the meter's line."""
  steps = study_driver.checkpoint_steps(plan.run_dir(cell, stage))
  if not steps or _done(plan, cell, stage):
    return None
  step, wd = steps[-1], plan.run_dir(cell, stage)
  t0 = time.time()
  with study_driver.lowest_optimisation(plan.fast_compile):
    cells, digest = score_run(plan, wd, step)
  arm, size, train, seed = parse_cell(cell)
  summary = study_driver.read_json(os.path.join(wd, "summary.json")) or {}
  c = plan.config(cell, stage)
  out = {
    "study": "copying",
    "preset": plan.preset,
    "cell": cell,
    "arm": arm,
    "size": size,
    "train": train,
    "seed": seed,
    "stage": stage,
    "post_trained": stage != "pretrain",
    "strategy": c.train.initial_state,
    "step": step,
    "train_copy": [int(c.data.copying.min_copy_len), int(c.data.copying.copy_len)],
    "sequences": plan.steps(cell, "pretrain") * int(c.data.global_batch_size),
    "post_steps": step if stage != "pretrain" else 0,
    "non_embedding_params": study_config.non_embedding(arm, size),
    "num_params": summary.get("num_params"),
    "train_wall_s": summary.get("wall_time_s"),
    "eval_wall_s": round(time.time() - t0, 1),
    "eval": {
      "lengths": list(plan.lengths),
      "examples": plan.examples,
      "seed": plan.eval_seed,
      "hash": digest,
    },
    "cells": cells,
  }
  write_json(_result(plan, cell, stage), out)
  at = {x["copy_len"]: x for x in cells}
  n = 300 if 300 in at else max(at)
  return (
    f"{cell} {stage} @ step {step} evaluated: character accuracy at L={n} "
    f"{at[n]['char_acc_tf']:.3f} teacher-forced, {at[n]['char_acc_fr']:.3f} free-running"
  )


STUDY = study_driver.Study(
  module="experiments.studies.copying",
  unit="cell",
  work=cell_work,
  train=train_stage,
  evaluate=evaluate_next,
)


# ------------------------------------------------------------------------------------------ throughput
def measure_throughput(plan, steps: int = THROUGHPUT_STEPS) -> dict:
  """Steady tokens/s of each distinct (arm, size, training range) of the plan (``sp`` shares the
  zero cells' shape: its state passing adds a select per step), trained alone for ``steps`` steps
  in ``<workdir>/throughput``, and the minutes each cell's runs (training and post-trainings) would
  take at it alone on the device; written to ``<results>/throughput.json``."""
  groups = {}
  for cell in plan.cells:
    arm, size, train, _ = parse_cell(cell)
    groups.setdefault(f"{arm}.{size}.l{TRAINS[train][0]}", []).append(cell)
  rows = []
  for shape, cells in groups.items():
    wd = os.path.join(plan.workdir, "throughput", shape)
    summary, wall = study_driver.time_steps(
      plan.config(cells[0], "pretrain"), wd, steps, plan.fast_compile
    )
    tps = summary.get("steady_tokens_per_s") or summary.get("tokens_per_s")
    minutes = {
      cell: sum(plan.steps(cell, s) for s in ("pretrain", *plan.post_strategies(cell)))
      * plan.tokens_per_step(cell)
      / tps
      / 60
      for cell in cells
    }
    arm, size, _, _ = parse_cell(cells[0])
    n = study_config.non_embedding(arm, size)
    rows.append(
      {
        "shape": shape,
        "non_embedding_params": n,
        "num_params": summary.get("num_params"),
        "tokens_per_step": plan.tokens_per_step(cells[0]),
        "tokens_per_s": tps,
        "cell_minutes": minutes,
        "wall_s": round(wall, 1),
        "device_kind": summary.get("device_kind"),
      }
    )
    print(
      f"study: throughput {shape} ({n:,} non-embedding parameters): {tps:,.0f} tokens/s; its "
      f"{len(cells)} cells take {fmt_time(60 * sum(minutes.values()))} one after another "
      f"(longest {fmt_time(60 * max(minutes.values()))})",
      flush=True,
    )
  out = {"steps": steps, "sequences": plan.sequences, "rows": rows}
  os.makedirs(plan.results, exist_ok=True)
  write_json(os.path.join(plan.results, "throughput.json"), out)
  return out


# ------------------------------------------------------------------------------------------ drivers
def protocol(plan) -> str:
  c = plan.config(plan.cells[0], "pretrain")
  shapes = sorted({(parse_cell(x)[0], parse_cell(x)[1]) for x in plan.cells})
  sizes = "; ".join(
    f"{a} {z}: {study_config.non_embedding(a, z):,} non-embedding parameters "
    f"({', '.join(f'{k} {v}' for k, v in study_config.shape(a, z))})"
    for a, z in shapes
  )
  return (
    f"preset {plan.preset}, {len(plan.cells)} cells (arm x size x train x seed): {sizes}; "
    f"vocabulary {study_config.VOCAB} (29 symbols); {plan.sequences:,} training sequences per "
    f"cell (batch {c.data.global_batch_size}, peak lr {c.optim.learning_rate:g}, "
    f"{WARMUP_FRACTION:g} warm-up, cosine), from scratch; train zero / sp (state passing, reset "
    f"probability {c.train.state_reset_prob:g}) on L ~ U[50, 100], cap (zero) on L ~ U[50, 300]; "
    f"post-training of the zero cells for {plan.post_fraction:g} of the steps at "
    f"{plan.post_lr_scale:g}x the rate (fresh optimizer): {', '.join(plan.strategies)}. "
    f"Evaluation from the zero state: L = {', '.join(map(str, plan.lengths))}, {plan.examples} "
    f"strings each from seed {plan.eval_seed} (the same for every run), teacher-forced and "
    "free-running (greedy)"
  )


def table(plan) -> str:
  from experiments.studies.copying import render as renderer  # pylint: disable=g-import-not-at-top

  return renderer.render_tables(renderer.load_runs(plan.results))


# ------------------------------------------------------------------------------------------ command line
study_driver.define_flags(FLAGS, STUDY, PRESETS, STRATEGIES, DRIVER_FLAGS)


def main(argv):
  del argv
  instead = measure_throughput if FLAGS.measure_throughput else None
  return study_driver.main(STUDY, FLAGS, Plan, protocol=protocol, table=table, instead=instead)
