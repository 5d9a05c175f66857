"""The length-generalisation map (configs/lengen_map.py): where does PPL past the training length
fail, over mixer x size x T x seed, as pretraining tokens per non-embedding parameter grow; and,
where a cell fails, does post-training with carried states fix it?

    # CPU, under a minute: one tiny cell on a generated toy corpus, then its fix stage
    python -m experiments.studies.lengen_map --preset=tiny --toy_corpus --fix
    # one GPU: tokens/s of each cell shape first (to plan budgets), then the map, 8 cells at a time
    python -m experiments.studies.lengen_map --preset=gpu --measure_throughput --workdir=/tmp/map
    python -m experiments.studies.lengen_map --preset=gpu --parallel=8 --deadline_s=540 \\
        --corpus_dir=/tmp/kdn_code --workdir=/tmp/map --results=$OUT/map

Cells are ``<arm>.<size>.t<T>.s<seed>`` (arms mamba2, mamba2_long, gla, kdn_diag; sizes 500k, 2m,
8m; T 64, 256; seeds 0, 1 on ``gpu``). Each pretrains from the zero state on the code corpus for
the largest of ``--budgets`` (tokens per non-embedding parameter, default 25/50/100/200/400; a size
stops at ``--caps``, 8m at 100) with a checkpoint kept at each budget, evaluated as it appears. The
seed sets the initial parameters and the data order.

Cell order (the most likely failures first, so a stopped map has the informative cells): T
ascending (a given state against a shorter training length), then the arm's dt_max ascending
(longer time constants at init), then the budget reached descending (more tokens per parameter),
then recurrent state entries per layer descending (official Mamba-2's expand-2, 128-state heads
before GLA / KDN's 64 x 64 heads; larger sizes before smaller), then the seed. ``--parallel=N``
starts them N at a time in that order.

Evaluation of every checkpoint (experiments/evaluation/band_ratio.py): ``--windows`` (256) windows
of ``--eval_len`` (8192) tokens of the corpus's in-domain ``long_val`` files (one per file first,
``long_context.spread_windows``), fed in chunks of ``--chunk`` with the state carried, from the zero
state; per window the mean NLL in each doubling band [2^k, 2^(k+1)) (stored, so intervals can be
recomputed and paired across checkpoints); R = PPL[L/2, L) / min over the bands in [T/8, T) with a
bootstrap over windows that chooses the band again in every resample; each head's memory norm
(mean over windows) after t = 8, 16, ..., L tokens; each head's time constant at zero input
1 / (exp(A_log) softplus(dt_bias)) (probes.time_constants); EffRem at T_eval = ``--effrem_len``
(1024) over ``--effrem_windows`` windows.

``--fix``: a cell whose last checkpoint fails (R >= 1.5 with its lower end >= 1.3; the rule in
experiments/studies/lengen_map/render.py) and whose other seeds do not pass there is post-trained
from that checkpoint for ``--post_fraction`` (2%) of its pretraining steps at ``--post_lr_scale``
(0.1) x the peak rate with a fresh optimizer, once per ``--strategies`` (zero, the control;
state_passing; tbtt; fitted_noise; random_noise), each evaluated the same way. Without its
checkpoint (a new machine) the pretraining is run again first (deterministic from the seed; its
evaluations are kept).

Resumable: a result this plan wrote is skipped, a stopped run resumes from its checkpoint, a
workdir of another plan is refused (study_plan.py); ``--deadline_s`` stops cleanly. On a machine
that loses its disk between stretches, carry the results folder back: finished checkpoints and
cells are skipped, an unfinished cell trains again from the start. Results:
``<results>/<cell>.pretrain.step<k>.json`` and ``<results>/<cell>.<strategy>.json``, rendered by
experiments/studies/lengen_map/render.py; ``--publish`` copies them into
docs/results (its lengen_map/<preset> folder).

``--measure_throughput`` trains each distinct (arm, size, T) a few steps alone and writes
``<results>/throughput.json``: steady tokens/s and the hours each cell's pretraining would take.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import time

import numpy as np
from absl import flags

from configs import lengen_map as study_config
from experiments import schema
from experiments.evaluation import band_ratio
from experiments.runner.logging_utils import fmt_time, write_json
from experiments.studies import study_driver, study_plan
from experiments.studies.lengen_map import render as renderer
from experiments.studies.lengen_text import study as lengen_text

PRESETS = ("tiny", "gpu")
STRATEGIES = ("zero", "state_passing", "tbtt", "fitted_noise", "random_noise")
DEFAULTS = {
  "tiny": dict(
    arms=("gla",),
    sizes=("tiny",),
    lengths=(16,),
    seeds="0",
    budgets=(0.05, 0.1),
    caps={},
    windows=4,
    eval_len=256,
    chunk=128,
    effrem_len=64,
    effrem_windows=2,
    batch=4,
  ),
  "gpu": dict(
    arms=tuple(study_config.ARMS),
    sizes=("500k", "2m", "8m"),
    lengths=study_config.LENGTHS,
    seeds="0,1",
    budgets=(25, 50, 100, 200, 400),
    caps={"8m": 100},
    windows=256,
    eval_len=8192,
    chunk=1024,
    effrem_len=1024,
    effrem_windows=32,
    batch=32,
  ),
}
EFFREM_POINTS = 33
THROUGHPUT_STEPS = 40  # steps per shape measured (the first logged interval holds the compile)
# the optional flags of study_driver.SHARED_FLAGS this study takes
DRIVER_FLAGS = "post_lr_scale corpus_dir toy_corpus windows chunk resamples seed fast_compile"


# this study's own flags; those every study takes: study_driver.define_flags below
FLAGS = flags.FlagValues()
flags.DEFINE_list("arms", [], "arms (configs/lengen_map.py ARMS; default: all)", flag_values=FLAGS)
flags.DEFINE_list("sizes", [], "sizes (default gpu: 500k,2m,8m)", flag_values=FLAGS)
flags.DEFINE_list("lengths", [], "training lengths T (default gpu: 64,256)", flag_values=FLAGS)
flags.DEFINE_string("seeds", "", "seeds (default gpu: 0,1)", flag_values=FLAGS)
flags.DEFINE_list(
  "cells", [], "<arm>.<size>.t<T>.s<seed> cells (default: every combination)", flag_values=FLAGS
)
flags.DEFINE_list(
  "budgets", [], "kept checkpoints in tokens per non-embedding parameter", flag_values=FLAGS
)
flags.DEFINE_list(
  "caps",
  [],
  "<size>:<tokens per parameter> the largest budget of a size (gpu: 8m:100)",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "fix", False, "post-train the failing cells with each strategy", flag_values=FLAGS
)
flags.DEFINE_float("post_fraction", 0.02, "post-training steps / pretraining", flag_values=FLAGS)
flags.DEFINE_integer("eval_len", 0, "evaluated length, a power of two", flag_values=FLAGS)
flags.DEFINE_integer("effrem_len", 0, "EffRem's T_eval", flag_values=FLAGS)
flags.DEFINE_integer("effrem_windows", 0, "windows EffRem averages", flag_values=FLAGS)
flags.DEFINE_integer("batch", 0, "windows per evaluation forward", flag_values=FLAGS)
flags.DEFINE_bool(
  "measure_throughput", False, "time each cell shape a few steps; no map", flag_values=FLAGS
)


# ------------------------------------------------------------------------------------------ cells
def parse_cell(cell: str) -> tuple[str, str, int, int]:
  """'<arm>.<size>.t<T>.s<seed>' -> (arm, size, T, seed)."""
  parts = cell.split(".")
  ok = (
    len(parts) == 4
    and parts[0] in study_config.ARMS
    and parts[1] in study_config.SIZES
    and parts[2][:1] == "t"
    and parts[2][1:].isdigit()
    and parts[3][:1] == "s"
    and parts[3][1:].isdigit()
  )
  if not ok:
    raise ValueError(
      f"--cells: expected <arm>.<size>.t<T>.s<seed> with an arm of {list(study_config.ARMS)} and "
      f"a size of {list(study_config.SIZES)}, got {cell!r}"
    )
  return parts[0], parts[1], int(parts[2][1:]), int(parts[3][1:])


def cell_name(arm, size, t, seed) -> str:
  return f"{arm}.{size}.t{t}.s{seed}"


def order_key(cell: str, caps: dict, budgets) -> tuple:
  """The module docstring's cell order: the most likely failures first."""
  arm, size, t, seed = parse_cell(cell)
  dt_max = float(study_config.ARMS[arm].get("dt_max", 0.1))
  reach = max(b for b in budgets if b <= caps.get(size, math.inf)) if budgets else 0
  return (t, dt_max, -reach, -study_config.state_elements(arm, size), seed, arm)


def parse_caps(items) -> dict:
  if isinstance(items, dict):
    return dict(items)
  out = {}
  for item in items:
    size, sep, v = item.partition(":")
    try:
      out[size] = float(v)
    except ValueError:
      sep = ""
    if not sep or size not in study_config.SIZES:
      raise ValueError(f"--caps: expected <size>:<tokens per parameter>, got {item!r}")
  return out


# ------------------------------------------------------------------------------------------ plan
class Plan:
  """The map's settings after defaults, validated before any work."""

  def __init__(
    self,
    preset="tiny",
    arms=(),
    sizes=(),
    lengths=(),
    seeds="",
    cells=(),
    budgets=(),
    caps=None,
    strategies=STRATEGIES,
    fix=False,
    post_fraction=0.02,
    post_lr_scale=0.1,
    workdir="",
    results="",
    corpus_dir="",
    toy_corpus=False,
    windows=0,
    eval_len=0,
    chunk=0,
    effrem_len=0,
    effrem_windows=0,
    batch=0,
    resamples=2000,
    seed=0,
    deadline_s=0,
    overrides=(),
    fast_compile=None,
    publish=False,
  ):
    study_driver.check_choice("--preset", preset, PRESETS)
    d = DEFAULTS[preset]
    self.preset = preset
    self.budgets = tuple(sorted(float(b) for b in budgets)) or tuple(float(b) for b in d["budgets"])
    if any(b <= 0 for b in self.budgets):
      raise ValueError(f"--budgets: expected positive tokens per parameter, got {self.budgets}")
    self.caps = parse_caps(caps) if caps else dict(d["caps"])
    if not cells:
      for a in arms:
        if a not in study_config.ARMS:
          raise ValueError(f"--arms: unknown {a!r}; expected {list(study_config.ARMS)}")
      for s in sizes:
        if s not in study_config.SIZES:
          raise ValueError(f"--sizes: unknown {s!r}; expected {list(study_config.SIZES)}")
      seed_list = schema.parse_seeds(seeds or d["seeds"])
      cells = [
        cell_name(a, s, int(t), sd)
        for a in (arms or d["arms"])
        for s in (sizes or d["sizes"])
        for t in (lengths or d["lengths"])
        for sd in seed_list
      ]
    for c in cells:
      _, size, _, _ = parse_cell(c)
      if min(self.budgets) > self.caps.get(size, math.inf):
        raise ValueError(f"--caps: {size} is capped below every budget {list(self.budgets)}")
    self.cells = tuple(
      sorted(dict.fromkeys(cells), key=lambda c: order_key(c, self.caps, self.budgets))
    )
    self.strategies = study_driver.check_strategies(strategies)
    study_driver.check_non_negative(
      windows=windows, eval_len=eval_len, chunk=chunk, effrem_len=effrem_len, deadline_s=deadline_s
    )
    study_driver.check_resamples(resamples)
    if not 0 < post_fraction <= 0.5:
      raise ValueError(f"--post_fraction: expected a fraction in (0, 0.5], got {post_fraction}")
    if not 0 < post_lr_scale <= 1:
      raise ValueError(f"--post_lr_scale: expected a value in (0, 1], got {post_lr_scale}")
    self.post_fraction, self.post_lr_scale = post_fraction, post_lr_scale
    self.windows = windows or d["windows"]
    if self.windows < 2:
      raise ValueError(f"--windows: the intervals need >= 2 windows, got {self.windows}")
    self.eval_len = eval_len or d["eval_len"]
    if self.eval_len < 2 or self.eval_len & (self.eval_len - 1):
      raise ValueError(f"--eval_len: expected a power of two (the doubling bands), got {eval_len}")
    self.chunk = min(chunk or d["chunk"], self.eval_len)
    self.effrem_len = min(effrem_len or d["effrem_len"], self.eval_len)
    self.effrem_windows = min(effrem_windows or d["effrem_windows"], self.windows)
    self.batch = min(batch or d["batch"], self.windows)
    self.resamples, self.seed = resamples, seed
    for c in self.cells:
      t = parse_cell(c)[2]
      if 8 * t > self.eval_len:
        raise ValueError(f"--eval_len: {self.eval_len} is short for T = {t}; give >= 8 T")
      band_ratio.reference_bands(band_ratio.band_edges(self.eval_len), t)
    self.workdir = workdir or f"/tmp/lengen_map_{preset}"
    self.results = results or os.path.join(self.workdir, "results", preset)
    self.toy_corpus = toy_corpus
    self.corpus_dir = (
      os.path.join(self.workdir, "toy_corpus") if toy_corpus else corpus_dir or "/tmp/kdn_code"
    )
    self.long_path = os.path.join(self.corpus_dir, "long_val.npy")
    self.deadline = study_driver.Deadline(deadline_s)
    self.fast_compile = preset == "tiny" if fast_compile is None else fast_compile
    self.publish = publish
    self.overrides = study_driver.parse_overrides(overrides)
    self._fix = fix  # which work is asked for, not what a cell computes: outside the plan's hash
    self.config(self.cells[0], "pretrain")  # a bad override fails here, naming the key

  def vocab_size(self) -> int:
    manifest = study_driver.read_json(os.path.join(self.corpus_dir, "manifest.json"))
    if self.toy_corpus:
      return lengen_text.TOY_VOCAB
    return int(manifest["vocab_size"]) if manifest else 8192

  def non_embedding(self, cell) -> int:
    arm, size, _, _ = parse_cell(cell)
    return study_config.non_embedding(arm, size)

  def tokens_per_step(self, cell) -> int:
    c = self._base(cell)
    return int(c.data.global_batch_size) * int(c.data.seq_len)

  def cell_budgets(self, cell) -> list[float]:
    size = parse_cell(cell)[1]
    return [b for b in self.budgets if b <= self.caps.get(size, math.inf)]

  def keep_steps(self, cell) -> list[int]:
    """The pretraining steps kept and evaluated: one per budget the cell reaches."""
    n, tps = self.non_embedding(cell), self.tokens_per_step(cell)
    return sorted({max(1, round(b * n / tps)) for b in self.cell_budgets(cell)})

  def steps(self, cell, stage) -> int:
    pre = self.keep_steps(cell)[-1]
    return pre if stage == "pretrain" else max(1, round(self.post_fraction * pre))

  def run_dir(self, cell, stage):
    return os.path.join(self.workdir, cell, stage)

  def _base(self, cell):
    arm, size, t, _ = parse_cell(cell)
    c = study_config.get_config(f"{size},{arm},t{t}")
    study_driver.apply_overrides(c, self.overrides)
    return c

  def config(self, cell, stage):
    """The run config of ``stage`` ('pretrain' or a strategy) of ``cell``."""
    arm, size, t, seed = parse_cell(cell)
    c = study_config.get_config(f"{size},{arm},t{t}" + ("" if stage == "pretrain" else f",{stage}"))
    steps = self.steps(cell, stage)
    if stage == "pretrain":
      keep = self.keep_steps(cell)
      c.checkpoint.keep_steps = ",".join(str(s) for s in keep)
      c.checkpoint.every_steps = max(1, min(1000, steps // 10))  # resumable; only keep_steps stay
    else:
      c.train.init_from = os.path.join(
        self.run_dir(cell, "pretrain"), "checkpoints", str(self.keep_steps(cell)[-1])
      )
      c.optim.learning_rate = float(c.optim.learning_rate) * self.post_lr_scale
      c.checkpoint.every_steps = steps
    c.seed = c.data.shuffle_seed = seed
    c.train.num_steps = steps
    c.train.eval_every = 0
    c.optim.warmup_steps = max(1, round(study_config.WARMUP_FRACTION * steps))
    c.data.corpus_dir = self.corpus_dir
    c.data.long_eval_path = self.long_path
    c.model.vocab_size = self.vocab_size()
    study_driver.apply_overrides(c, self.overrides)
    return c


# ------------------------------------------------------------------------------------------ eval
@functools.lru_cache(maxsize=4)
def eval_windows(long_path: str, length: int, n: int, seed: int) -> tuple[np.ndarray, str]:
  """[n, length + 1] windows of the long_val files (one per file first) and their hash."""
  from experiments.data import token_files  # pylint: disable=g-import-not-at-top
  from experiments.evaluation import long_context, suites  # pylint: disable=g-import-not-at-top

  tokens = token_files.load_tokens(long_path)
  off = token_files.load_offsets(long_path, tokens, -1)
  if off is None:
    raise ValueError(f"--corpus_dir: {long_path} has no document offsets (.docs.npy)")
  eos = int(
    (study_driver.read_json(os.path.join(os.path.dirname(long_path), "manifest.json")) or {}).get(
      "eos_id", 0
    )
  )
  w, _ = long_context.spread_windows(tokens, off, length, eos, n, seed)
  return w, suites.examples_hash(w)


def evaluated(plan, path, step) -> bool:
  """Whether the JSON at ``path`` is ``step``'s evaluation with the plan's settings."""
  r = study_driver.read_json(path)
  e = (r or {}).get("eval", {})
  return (
    bool(r)
    and r.get("step") == step
    and e.get("windows") == plan.windows
    and e.get("length") == plan.eval_len
    and e.get("seed") == plan.seed
  )


def _result_done(plan, cell, stage, step=None) -> bool:
  path = study_driver.result_path(plan, cell, stage, step)
  if stage != "pretrain":
    r = study_driver.read_json(path)
    step = (r or {}).get("step")
    if step != plan.steps(cell, stage):
      return False
  return study_driver.done(plan, cell, evaluated, path, step)


def selected_for_fix(plan, cell) -> bool:
  """Post-train ``cell`` under --fix: its last checkpoint fails the rule and no other seed of its
  (arm, size, T) evaluated there passes."""
  if not plan._fix:
    return False
  last = plan.keep_steps(cell)[-1]
  path = study_driver.result_path(plan, cell, "pretrain", last)
  if not _result_done(plan, cell, "pretrain", last):
    return False
  if not renderer.fails(study_driver.read_json(path)["ratio"]):
    return False
  arm, size, t, seed = parse_cell(cell)
  # the other seeds from the results folder: a --parallel child's plan holds its own cell only
  pattern = os.path.join(
    glob.escape(plan.results), f"{arm}.{size}.t{t}.s*.pretrain.step{last}.json"
  )
  for other in glob.glob(pattern):
    r = study_driver.read_json(other)
    if (
      r
      and r.get("seed") != seed
      and evaluated(plan, other, last)
      and not renderer.fails(r["ratio"])
    ):
      return False
  return True


def cell_work(plan, cell) -> list[tuple]:
  """(kind, stage, units) still to do: evaluations of kept checkpoints already on disk, the
  pretraining if a kept step lacks its result (or --fix needs the last checkpoint again), the
  other evaluations, then under --fix each strategy's post-training and evaluation."""
  pre = plan.run_dir(cell, "pretrain")
  tps, steps = plan.tokens_per_step(cell), plan.steps(cell, "pretrain")
  eval_units = plan.windows * plan.eval_len * study_driver.EVAL_COST
  keep = plan.keep_steps(cell)
  have = set(study_driver.checkpoint_steps(pre))
  missing = [s for s in keep if not _result_done(plan, cell, "pretrain", s)]
  work = [("eval", "pretrain", eval_units) for s in missing if s in have]
  todo = [s for s in missing if s not in have]
  fix = (
    [s for s in plan.strategies if not _result_done(plan, cell, s)]
    if selected_for_fix(plan, cell)
    else []
  )
  need_last = (
    any(not study_driver.checkpoint_steps(plan.run_dir(cell, s)) for s in fix)
    and keep[-1] not in have
  )
  if (todo or need_last) and not study_driver.trained(pre, steps):
    work.append(("train", "pretrain", steps * tps))
    work += [("eval", "pretrain", eval_units)] * len(todo)
  post = plan.steps(cell, fix[0]) if fix else 0
  for s in fix:
    if not study_driver.trained(plan.run_dir(cell, s), post):
      work.append(("train", s, post * tps))
    work.append(("eval", s, eval_units))
  return work


def train_stage(plan, cell, stage) -> dict | None:
  return study_driver.train(plan, cell, stage, plan.fast_compile)


def measure(plan, workdir: str, step: int) -> dict:
  """One checkpoint's evaluation (module docstring): band NLL per window, R, head norms, time
  constants, EffRem."""
  from experiments import loading  # pylint: disable=g-import-not-at-top  (imports jax)
  from experiments.evaluation import long_context, probes  # pylint: disable=g-import-not-at-top

  windows, digest = eval_windows(plan.long_path, plan.eval_len, plan.windows, plan.seed)
  run = loading.load(workdir, step)
  scorer = long_context.ChunkedScorer(run.model)
  edges = band_ratio.band_edges(plan.eval_len)
  ends = [1 << k for k in range(3, plan.eval_len.bit_length())]
  bands, sums = [], {}

  n = len(windows)
  for s in range(0, n, plan.batch):
    w = windows[s : s + plan.batch]
    real = len(w)
    if real < plan.batch:  # one compiled shape: the last batch padded with its first row
      w = np.concatenate([w, np.repeat(w[:1], plan.batch - real, axis=0)])
    nll, _ = scorer.score(w[:, :-1], w[:, 1:], plan.chunk)
    bands.append(band_ratio.band_nll(nll[:real], edges))

    def on_state(t, cache, real=real):
      for i, v in enumerate(probes.head_norms(cache)):
        if v is not None:
          sums.setdefault(t, {})[i] = sums.get(t, {}).get(i, 0.0) + v[:real].sum(axis=0)

    scorer.states_at(w[:, :-1], ends, on_state)
  bands = np.round(np.concatenate(bands), 5)  # stored so; every statistic from what is stored
  t_len = int(run.config.data.seq_len)
  ts = long_context.effrem_grid(plan.effrem_len, EFFREM_POINTS)
  er = long_context.effective_remembrance(
    scorer, windows[: plan.effrem_windows, : plan.effrem_len], ts, batch=plan.batch
  )
  layers = sorted({i for per in sums.values() for i in per})
  kw = {"resamples": plan.resamples, "seed": plan.seed}
  return {
    "eval": {
      "windows": n,
      "length": plan.eval_len,
      "chunk": plan.chunk,
      "seed": plan.seed,
      "hash": digest,
      "long_path": os.path.basename(plan.long_path),
      "band_edges": edges,
    },
    "band_nll": bands.tolist(),
    "band_ppl": np.exp(bands.mean(axis=0)).tolist(),
    "ratio": band_ratio.ratio(bands, edges, t_len, **kw),
    "in_range_ppl": float(np.exp(band_ratio.in_range_nll(bands.mean(axis=0), edges, t_len))),
    "state_norm": {
      "t": ends,
      "layers": [[(sums[t][i] / n).tolist() for t in ends] for i in layers],
    },
    "time_constants": probes.time_constants(run.model),
    "effrem": {
      "T": plan.effrem_len,
      "t": ts.tolist(),
      "mean": er.mean(0).tolist(),
      "windows": len(er),
    },
  }


def evaluate_next(plan, cell, stage) -> str | None:
  """Evaluates the next kept checkpoint of ``stage`` without its result; the meter's line."""
  if stage == "pretrain":
    have = set(study_driver.checkpoint_steps(plan.run_dir(cell, stage)))
    todo = [
      s for s in plan.keep_steps(cell) if s in have and not _result_done(plan, cell, stage, s)
    ]
  else:
    todo = (
      []
      if _result_done(plan, cell, stage)
      else study_driver.checkpoint_steps(plan.run_dir(cell, stage))[-1:]
    )
  if not todo:
    return None
  step, wd = todo[0], plan.run_dir(cell, stage)
  t0 = time.time()
  res = measure(plan, wd, step)
  arm, size, t, seed = parse_cell(cell)
  summary = study_driver.read_json(os.path.join(wd, "summary.json")) or {}
  n = plan.non_embedding(cell)
  pre_tokens = (
    step if stage == "pretrain" else plan.steps(cell, "pretrain")
  ) * plan.tokens_per_step(cell)
  out = {
    "study": "lengen_map",
    "preset": plan.preset,
    "cell": cell,
    "arm": arm,
    "size": size,
    "train_len": t,
    "seed": seed,
    "stage": stage,
    "strategy": "zero" if stage == "pretrain" else stage,
    "post_trained": stage != "pretrain",
    "step": step,
    "non_embedding_params": n,
    "state_elements_per_layer": study_config.state_elements(arm, size),
    "tokens": pre_tokens,
    "tokens_per_param": pre_tokens / n,
    "post_tokens": 0 if stage == "pretrain" else step * plan.tokens_per_step(cell),
    "train_wall_s": summary.get("wall_time_s"),
    "eval_wall_s": None,
    **res,
  }
  out["eval_wall_s"] = round(time.time() - t0, 1)
  write_json(
    study_driver.result_path(plan, cell, stage, step if stage == "pretrain" else None), out
  )
  r = out["ratio"]
  return (
    f"{cell} {stage} @ step {step} ({out['tokens_per_param']:.3g} tokens/param) evaluated: "
    f"R {r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"
  )


STUDY = study_driver.Study(
  module="experiments.studies.lengen_map",
  unit="cell",
  work=cell_work,
  train=train_stage,
  evaluate=evaluate_next,
)


# ------------------------------------------------------------------------------------------ throughput
def measure_throughput(plan, steps: int = THROUGHPUT_STEPS) -> dict:
  """Steady tokens/s of each distinct (arm, size, T) of the plan, trained alone for ``steps``
  steps in ``<workdir>/throughput``, and the hours each cell's pretraining would take at it;
  written to ``<results>/throughput.json``."""
  shapes = list(dict.fromkeys(c.rsplit(".", 1)[0] for c in plan.cells))
  rows = []
  for shape in shapes:
    cell = f"{shape}.s0"
    wd = os.path.join(plan.workdir, "throughput", shape)
    summary, wall = study_driver.time_steps(
      plan.config(cell, "pretrain"), wd, steps, plan.fast_compile
    )
    tps = summary.get("steady_tokens_per_s") or summary.get("tokens_per_s")
    budget = plan.steps(cell, "pretrain") * plan.tokens_per_step(cell)
    row = {
      "shape": shape,
      "non_embedding_params": plan.non_embedding(cell),
      "tokens_per_step": plan.tokens_per_step(cell),
      "tokens_per_s": tps,
      "budget_tokens": budget,
      "pretrain_hours": budget / tps / 3600 if tps else None,
      "wall_s": round(wall, 1),
      "device_kind": summary.get("device_kind"),
    }
    rows.append(row)
    print(
      f"study: throughput {shape}: {tps:,.0f} tokens/s; pretraining {budget:,} tokens = "
      f"{fmt_time(budget / tps)} alone",
      flush=True,
    )
  out = {"steps": steps, "rows": rows}
  os.makedirs(plan.results, exist_ok=True)
  write_json(os.path.join(plan.results, "throughput.json"), out)
  return out


# ------------------------------------------------------------------------------------------ drivers
def prepare_inputs(plan):
  """The toy corpus written (when asked for), and the long_val split there, before any work."""
  study_plan.check_outside_repo(plan)
  if plan.toy_corpus:
    lengen_text.write_toy_corpus(plan.corpus_dir, long_len=plan.eval_len + 1)
  if not os.path.exists(plan.long_path):
    raise ValueError(
      f"--corpus_dir: {plan.long_path} does not exist; prepare the code corpus (python -m "
      "experiments.data.prepare --recipe=linux_c --out=<dir>) or ship it (experiments/data/ship.py)"
    )


def protocol(plan) -> str:
  c = plan.config(plan.cells[0], "pretrain")
  return (
    f"preset {plan.preset}: {len(plan.cells)} cells (arm x size x T x seed), vocabulary "
    f"{c.model.vocab_size}, budgets {list(plan.budgets)} tokens per non-embedding parameter "
    f"(caps {plan.caps}), checkpoints kept at each; post-training under --fix for "
    f"{plan.post_fraction:g} of the pretraining steps at {plan.post_lr_scale:g}x the peak rate; "
    f"evaluation on {plan.windows} long_val windows of {plan.eval_len} tokens (seed {plan.seed}), "
    f"state carried in chunks of {plan.chunk}, EffRem at T={plan.effrem_len}, {plan.resamples} "
    "bootstrap resamples over windows"
  )


def table(plan) -> str:
  return renderer.render_tables(renderer.load_runs(plan.results))


# ------------------------------------------------------------------------------------------ command line
study_driver.define_flags(FLAGS, STUDY, PRESETS, STRATEGIES, DRIVER_FLAGS)


def main(argv):
  del argv
  instead = measure_throughput if FLAGS.measure_throughput else None
  return study_driver.main(
    STUDY, FLAGS, Plan, protocol=protocol, table=table, prepare=prepare_inputs, instead=instead
  )
