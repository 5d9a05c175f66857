"""One (width, mixer) of the MQAR Zoology study: trains every learning rate x seed at once (a vmapped
sweep, experiments/runner/lr_sweep.py), then scores every member on the validation and test cells and
writes ``<workdir>/cells.json`` (per member and cell: each example's correctly recalled values).

    python -m experiments.studies.mqar_zoology_sweep --config=configs/mqar_zoology.py:d64,kda \\
        --workdir=/tmp/zoology/d64/kda [--stop_at_time=<unix seconds>] [--config.train.num_steps=3000]

Rerunning resumes: training from the latest checkpoint, and a finished training whose scoring did not
complete is scored again from its final checkpoint. ``--stop_at_time`` stops training cleanly at that
time (a checkpoint is saved); scoring only follows a completed training.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from configs import mqar_zoology as zoo
from experiments import config_checks, schema
from experiments.runner import cli
from experiments.studies import study_driver

FLAGS = flags.FlagValues()
config_flags.DEFINE_config_file(
  "config",
  None,
  "configs/mqar_zoology.py:d<width>,<mixer>[,tiny]",
  flag_values=FLAGS,
  lock_config=True,
)
flags.DEFINE_string("workdir", None, "the sweep's workdir", flag_values=FLAGS)
flags.DEFINE_float(
  "stop_at_time",
  0.0,
  "unix time at which training stops with a checkpoint (0: none)",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "test_cells",
  [f"{t}:{n}" for t, n in zoo.TEST_CELLS],
  "evaluation cells <seq_len>:<pairs>",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "validation_examples", zoo.VALIDATION_EXAMPLES, "examples per validation cell", flag_values=FLAGS
)
flags.DEFINE_integer(
  "test_examples", zoo.TEST_EXAMPLES, "examples per test cell", flag_values=FLAGS
)
flags.DEFINE_integer("eval_rows", 64, "rows per evaluation forward pass", flag_values=FLAGS)

CELLS_FILE = "cells.json"


def parse_cells(items) -> list[tuple[int, int]]:
  cells = []
  for item in items:
    try:
      t, n = (int(x) for x in str(item).split(":"))
    except ValueError:
      raise ValueError(f"--test_cells: expected <seq_len>:<pairs>, got {item!r}") from None
    if t < 4 * n or n < 1:
      raise ValueError(f"--test_cells: {item!r} needs 1 <= pairs and seq_len >= 4 x pairs")
    cells.append((t, n))
  if not cells:
    raise ValueError("--test_cells: empty")
  return cells


def score(tr, test_cells, validation_examples, test_examples, rows) -> dict:
  """{'validation' | 'test': {'seed', 'cells': [{'seq_len', 'num_kv_pairs', 'correct': [[members][N]]}]}}."""
  from experiments.evaluation import mqar_cells  # pylint: disable=g-import-not-at-top  (imports jax)

  q = tr.config.data.mqar
  out = {}
  for split, n, seed in (
    ("validation", validation_examples, zoo.VALIDATION_SEED),
    ("test", test_examples, zoo.TEST_SEED),
  ):
    cells = mqar_cells.make_cells(test_cells, n, seed, int(q.vocab_size), float(q.power_a))
    counts = mqar_cells.correct_counts(tr, cells, min_len=int(tr.config.data.seq_len), rows=rows)
    out[split] = {
      "seed": seed,
      "examples": n,
      "cells": [
        {"seq_len": c["seq_len"], "num_kv_pairs": c["num_kv_pairs"], "correct": k.tolist()}
        for c, k in zip(cells, counts)
      ],
    }
  return out


def run(
  config,
  workdir: str,
  stop_at_time: float = 0.0,
  test_cells=None,
  validation_examples=None,
  test_examples=None,
  rows: int = 64,
) -> dict | None:
  """Trains (or resumes) and scores; returns the cells.json record, or None when training stopped first."""
  from experiments.runner import lr_sweep  # pylint: disable=g-import-not-at-top  (imports jax)
  from experiments.runner.logging_utils import write_json  # pylint: disable=g-import-not-at-top

  test_cells = list(test_cells or zoo.TEST_CELLS)
  tr = lr_sweep.make_trainer(config, workdir)
  try:
    with study_driver.stop_after(tr, stop_at_time - time.time() if stop_at_time else None):
      summary = tr.run()
    if summary["status"] != "completed":
      print(
        f"training stopped at step {tr.step()}/{config.train.num_steps}; rerun to resume",
        flush=True,
      )
      return None
    if not summary.get("steps_this_run") and os.path.exists(os.path.join(workdir, "summary.json")):
      with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)  # trained by an earlier call: its timings
    t0 = time.time()
    print(f"scoring {len(tr.members)} members on {len(test_cells)} cells", flush=True)
    splits = score(
      tr,
      test_cells,
      validation_examples or zoo.VALIDATION_EXAMPLES,
      test_examples or zoo.TEST_EXAMPLES,
      rows,
    )
    record = {
      "width": int(config.model.d_model),
      "mixer": str(config.model.mixer),
      "num_params": tr.num_params,
      "step": tr.step(),
      "num_steps": int(config.train.num_steps),
      "batch": int(config.data.global_batch_size),
      "train_cells": str(config.data.mqar.mixture),
      "vocab_size": int(config.data.mqar.vocab_size),
      "members": [
        {
          "learning_rate": lr,
          "seed": s,
          "status": "diverged" if i in tr.diverged else "completed",
          **({"diverged_at_step": tr.diverged[i]} if i in tr.diverged else {}),
        }
        for i, (lr, s) in enumerate(tr.members)
      ],
      "train_wall_time_s": summary.get("wall_time_s"),
      "steady_steps_per_s": _steps_per_s(summary, config),
      "eval_time_s": time.time() - t0,
      **splits,
    }
    write_json(os.path.join(workdir, CELLS_FILE), record)
    print(
      f"wrote {os.path.join(workdir, CELLS_FILE)} (scoring took {time.time() - t0:.0f}s)",
      flush=True,
    )
    return record
  finally:
    tr.close()


def _steps_per_s(summary, config):
  tps = summary.get("steady_tokens_per_s")
  return None if not tps else tps / (config.data.global_batch_size * config.data.seq_len)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  for name in ("config", "workdir"):
    if FLAGS[name].value is None:
      raise app.UsageError(f"--{name} is required")
  try:
    cells = parse_cells(FLAGS.test_cells)
    config = FLAGS.config
    config_checks.check(config)
  except (ValueError, schema.ConfigError) as e:
    raise app.UsageError(str(e)) from None
  run(
    config,
    FLAGS.workdir,
    FLAGS.stop_at_time,
    cells,
    FLAGS.validation_examples,
    FLAGS.test_examples,
    FLAGS.eval_rows,
  )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
