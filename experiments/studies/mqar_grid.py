"""Runs the MQAR grid of configs/mqar_grid.py (cells x mixers x learning rates) and collects it.

    python -m experiments.studies.mqar_grid --runs=workdirs/mqar --parallel=8 --out=docs/results/mqar
    python -m experiments.studies.mqar_grid --runs=workdirs/mqar --collect_only --out=docs/results/mqar

Each (cell, mixer) is one process training every learning rate at once (``experiments/runner/lr_sweep.py``):
``python -m experiments.train --config=configs/mqar_grid.py:<cell>,<mixer>
--config.train.lr_sweep=<lrs> --workdir=<runs>/<cell>/<mixer>``, each rate's run in ``.../lr<lr>``; several
processes share one accelerator. ``--nolr_sweep`` runs one process per rate instead
(``--config.optim.learning_rate=<lr> --workdir=<runs>/<cell>/<mixer>/lr<lr>``, the same folders), ordered
learning rate first so a stopped grid holds whole sweeps of the first rates. A completed run is skipped, an
interrupted one resumes from its checkpoint. ``--out`` gets
``grid.json`` (every run's final validation accuracy, the best rate per cell and mixer) and
``commands.json``; docs/RESULTS.md section 1 is rendered from them (experiments/studies/results/mqar.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time

from absl import app, flags

from configs import mqar_grid
from experiments.runner import cli
from experiments.runner.config_lib import sweep_member_dir
from experiments.runner.logging_utils import Progress, write_json

FLAGS = flags.FlagValues()
flags.DEFINE_string("runs", "workdirs/mqar", "root of the run workdirs", flag_values=FLAGS)
flags.DEFINE_string(
  "out", "", "folder for grid.json and commands.json (empty: only run)", flag_values=FLAGS
)
flags.DEFINE_list(
  "cells", list(mqar_grid.CELLS), "grid cells d<d_model>_t<seq_len>_kv<pairs>", flag_values=FLAGS
)
flags.DEFINE_list("mixers", list(mqar_grid.MIXERS), "mixers", flag_values=FLAGS)
flags.DEFINE_list(
  "lrs", [repr(lr) for lr in mqar_grid.LEARNING_RATES], "learning rates", flag_values=FLAGS
)
flags.DEFINE_integer("parallel", 4, "processes at a time", flag_values=FLAGS)
flags.DEFINE_bool(
  "lr_sweep",
  True,
  "one process per (cell, mixer) trains every rate at once (vmapped); false: one process per rate",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "run_timeout",
  0,
  "seconds per run (0: none); a stopped run saves and resumes later",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "deadline_s",
  0,
  "stop the grid after this many seconds (0: none): running runs get "
  "SIGTERM (they save a checkpoint and resume on the next call), none starts after",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "cpu", False, "the configs' tiny 'cpu' variant (checks the grid runs)", flag_values=FLAGS
)
flags.DEFINE_bool("collect_only", False, "only collect finished runs into --out", flag_values=FLAGS)
flags.DEFINE_string(
  "machine", "", "where the runs ran, recorded in commands.json", flag_values=FLAGS
)


def sweep_dir(root: str, cell: str, mixer: str) -> str:
  return os.path.join(root, cell, mixer)


def run_dir(root: str, cell: str, mixer: str, lr: float) -> str:
  return sweep_member_dir(sweep_dir(root, cell, mixer), lr)


def config_arg(cell: str, mixer: str, cpu: bool) -> str:
  return f"configs/mqar_grid.py:{cell},{mixer}" + (",cpu" if cpu else "")


def train_command(root: str, cell: str, mixer: str, lrs, cpu: bool) -> list[str]:
  """One process for ``lrs``: a float (one run) or a sequence of rates (one sweep)."""
  head = [sys.executable, "-m", "experiments.train", f"--config={config_arg(cell, mixer, cpu)}"]
  if isinstance(lrs, (int, float)):
    return head + [
      f"--config.optim.learning_rate={lrs!r}",
      f"--workdir={run_dir(root, cell, mixer, lrs)}",
    ]
  return head + [
    f"--config.train.lr_sweep=({','.join(repr(float(lr)) for lr in lrs)},)",
    f"--workdir={sweep_dir(root, cell, mixer)}",
  ]


def _summary(workdir: str) -> dict | None:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def completed(workdir: str) -> bool:
  s = _summary(workdir)
  return bool(s) and s.get("status") == "completed"


def check_grid(cells, mixers, lrs):
  """Bad cells, mixers or rates fail here, before any run starts."""
  for cell in cells:
    mqar_grid.parse_cell(cell)
  unknown = [m for m in mixers if m not in mqar_grid.MIXERS]
  if unknown:
    raise app.UsageError(f"--mixers: unknown {unknown}; the grid has {list(mqar_grid.MIXERS)}")
  for lr in lrs:
    if not lr > 0:
      raise app.UsageError(f"--lrs: learning rates must be > 0, got {lr}")


def run_order(lrs):
  """The middle learning rate first, then outwards: a grid stopped early holds whole sweeps of the most
  likely rates."""
  logs = sorted(math.log(lr) for lr in lrs)
  mid = (logs[0] + logs[-1]) / 2
  return sorted(lrs, key=lambda lr: (abs(math.log(lr) - mid), lr))


def grid_jobs(root, cells, mixers, lrs, sweep: bool):
  """(cell, mixer, lr or rates, log folder) per process still to run."""
  if sweep:
    jobs = [
      (cell, mixer, tuple(lrs), sweep_dir(root, cell, mixer)) for cell in cells for mixer in mixers
    ]
    return len(jobs), [
      j for j in jobs if not all(completed(run_dir(root, j[0], j[1], lr)) for lr in lrs)
    ]
  jobs = [
    (cell, mixer, lr, run_dir(root, cell, mixer, lr))
    for lr in run_order(lrs)
    for cell in cells
    for mixer in mixers
  ]
  return len(jobs), [j for j in jobs if not completed(j[3])]


def run_grid(root, cells, mixers, lrs, parallel, cpu, run_timeout=0, deadline_s=0, sweep=True):
  n_jobs, todo = grid_jobs(root, cells, mixers, lrs, sweep)
  kind = f"sweeps of {len(lrs)} rates" if sweep else "runs"
  print(
    f"MQAR grid: {n_jobs} {kind}, {n_jobs - len(todo)} already completed, {len(todo)} to run, "
    f"{parallel} at a time",
    flush=True,
  )
  env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  progress = Progress(len(todo), "MQAR runs", every_s=30.0)
  start = time.time()
  end = start + deadline_s if deadline_s else float("inf")

  outcome = {"ok": 0, "failed": 0}

  def one(job):
    cell, mixer, rates, wd = job
    name = f"{cell}/{mixer}/{rates}"
    if time.time() >= end or (outcome["failed"] >= parallel and not outcome["ok"]):
      progress.update()
      return f"{name}: not started (deadline, or every run so far failed)"
    os.makedirs(wd, exist_ok=True)
    t0 = time.time()
    limit = min(run_timeout or float("inf"), end - t0)
    with open(os.path.join(wd, "train.log"), "a", encoding="utf-8") as log:
      proc = subprocess.Popen(
        train_command(root, cell, mixer, rates, cpu), stdout=log, stderr=subprocess.STDOUT, env=env
      )
      try:
        rc = proc.wait(timeout=None if limit == float("inf") else limit)
      except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the trainer saves a checkpoint; the next call resumes the run
        rc = f"stopped ({proc.wait()})"
    accs = [
      ((_summary(run_dir(root, cell, mixer, lr)) or {}).get("eval") or {}).get("accuracy")
      for lr in (rates if sweep else [rates])
    ]
    outcome["ok" if rc == 0 else "failed"] += 1
    progress.update()
    return f"{name}: rc={rc} {time.time() - t0:.0f}s val_acc={accs}"

  with concurrent.futures.ThreadPoolExecutor(max(parallel, 1)) as pool:
    for line in pool.map(one, todo):
      print(line, flush=True)


def collect(root, cells, mixers, lrs) -> dict:
  """Every run's final validation accuracy and the best learning rate per (cell, mixer)."""
  runs, best = [], {}
  for cell in cells:
    d_model, seq_len, kv = mqar_grid.parse_cell(cell)
    for mixer in mixers:
      for lr in lrs:
        wd = run_dir(root, cell, mixer, lr)
        s = _summary(wd)
        row = dict(
          cell=cell,
          d_model=d_model,
          seq_len=seq_len,
          num_kv_pairs=kv,
          mixer=mixer,
          learning_rate=lr,
          status=(s or {}).get("status", "missing"),
        )
        if s:  # a stopped run has no final evaluation ('eval' is empty)
          row.update(
            accuracy=s["eval"].get("accuracy"),
            loss=s["eval"].get("loss"),
            step=s["step"],
            num_steps=s["num_steps"],
            num_params=s["num_params"],
            steady_tokens_per_s=s.get("steady_tokens_per_s"),
            sweep=bool(s.get("sweep")),
          )  # a member of a vmapped sweep, or a run of its own
        runs.append(row)
        done = row["status"] == "completed"
        key = f"{cell}/{mixer}"
        if done and (key not in best or row["accuracy"] > best[key]["accuracy"]):
          best[key] = dict(learning_rate=lr, accuracy=row["accuracy"], num_params=row["num_params"])
  return dict(
    runs=runs, best=best, cells=list(cells), mixers=list(mixers), learning_rates=list(lrs)
  )


def main(argv):
  del argv
  lrs = [float(x) for x in FLAGS.lrs]
  check_grid(FLAGS.cells, FLAGS.mixers, lrs)
  if not FLAGS.collect_only:
    run_grid(
      FLAGS.runs,
      FLAGS.cells,
      FLAGS.mixers,
      lrs,
      FLAGS.parallel,
      FLAGS.cpu,
      FLAGS.run_timeout,
      FLAGS.deadline_s,
      FLAGS.lr_sweep,
    )
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    grid = collect(FLAGS.runs, FLAGS.cells, FLAGS.mixers, lrs)
    write_json(os.path.join(FLAGS.out, "grid.json"), grid)
    if FLAGS.lr_sweep:
      run = " ".join(["python"] + train_command("<runs>", "<cell>", "<mixer>", lrs, FLAGS.cpu)[1:])
    else:
      run = " ".join(["python"] + train_command("<runs>", "<cell>", "<mixer>", 0.0, FLAGS.cpu)[1:])
      run = run.replace("learning_rate=0.0", "learning_rate=<lr>").replace("lr0", "lr<lr>")
    c = mqar_grid.get_config(config_arg(FLAGS.cells[0], FLAGS.mixers[0], FLAGS.cpu).split(":")[1])
    # what a person wrote into commands.json (the device calls, notes) survives a re-collect
    path = os.path.join(FLAGS.out, "commands.json")
    kept = {}
    if os.path.exists(path):
      with open(path) as fh:
        kept = {k: v for k, v in json.load(fh).items() if k not in ("grid", "run", "protocol")}
    if FLAGS.machine or "machine" not in kept:
      kept["machine"] = FLAGS.machine
    write_json(
      path,
      dict(
        kept,
        grid=(
          f"python -m experiments.studies.mqar_grid --runs=<runs> --parallel={FLAGS.parallel} "
          f"--out={FLAGS.out}"
          + (" --cpu" if FLAGS.cpu else "")
          + ("" if FLAGS.lr_sweep else " --nolr_sweep")
        ),
        run=run,
        protocol=(
          f"{c.train.num_steps} steps of {c.data.global_batch_size} sequences per run (AdamW, "
          f"weight decay {c.optim.weight_decay}, {c.optim.warmup_steps} warm-up steps, cosine to "
          f"{c.optim.min_lr_ratio} x the rate), vocabulary {c.data.mqar.vocab_size}, "
          f"{c.model.num_layers} layers of {c.model.num_heads} heads; accuracy = the values "
          f"predicted after every query key of {c.data.num_eval_examples} validation sequences at "
          "the end of training, from the zero state; best learning rate per cell and mixer."
        ),
      ),
    )
    n_done = sum(r["status"] == "completed" for r in grid["runs"])
    print(f"collected {n_done}/{len(grid['runs'])} completed runs into {FLAGS.out}/grid.json")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
