"""The MQAR Zoology study (configs/mqar_zoology.py): one process per (width, mixer), each training every
learning rate x seed at once and scoring them on the test cells; then the statistics and a JSON pack.

    python -m experiments.studies.mqar_zoology --runs=/tmp/zoology --widths=64,128 \\
        --mixers=kdn_diag,kda,kdn_iso,gated_deltanet --num_steps=3000 --batch=64 --parallel=4 \\
        --deadline_s=540 --out=$OUT/mqar_zoology
    python -m experiments.studies.mqar_zoology --runs=/tmp/zoology --collect_only --out=docs/results/mqar_zoology
    python -m experiments.studies.mqar_zoology ... --prior=docs/results/mqar_zoology   # a later call, fresh machine

Processes start mixer-major in the order given (list the most informative first), ``--parallel`` at a time on
one accelerator (experiments/studies/jobs.py: progress and ETA every 30 s). Calling again resumes: a sweep
whose ``cells.json`` matches the requested steps, batch, rates and seeds is skipped, others resume from
their checkpoints. ``--deadline_s`` stops every process cleanly (a checkpoint) before it runs out, then
collects what finished. ``--out`` (default ``$OUT/mqar_zoology`` when ``$OUT`` is set) gets
``zoology.json`` (experiments/studies/mqar_zoology/stats.py), ``commands.json`` and ``runs/d<w>/<mixer>/``
(each sweep's ``cells.json``: per-example correctness, what the paired bootstrap resamples). ``--prior``
names packs of earlier calls (their sweeps count as done and are collected too), so a call on a fresh
machine goes on from a committed pack; checkpoints of unfinished sweeps live only in ``--runs``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from absl import app, flags

from configs import mqar_zoology as zoo
from experiments.runner.logging_utils import write_json
from experiments.schema import ConfigError, parse_seeds
from experiments.studies import jobs as jobs_lib
from experiments.studies.mqar_zoology import stats
from experiments.studies.mqar_zoology_sweep import CELLS_FILE

FLAGS = flags.FlagValues()
flags.DEFINE_string(
  "runs", "workdirs/mqar_zoology", "root of the sweeps' workdirs", flag_values=FLAGS
)
flags.DEFINE_list("widths", [str(w) for w in zoo.WIDTHS], "model widths d", flag_values=FLAGS)
flags.DEFINE_list("mixers", list(zoo.MIXERS), "mixers, most informative first", flag_values=FLAGS)
flags.DEFINE_list(
  "lrs", [repr(lr) for lr in zoo.LEARNING_RATES], "learning rates", flag_values=FLAGS
)
flags.DEFINE_string("seeds", zoo.SEEDS, "seeds, e.g. 0,1,2", flag_values=FLAGS)
flags.DEFINE_integer("num_steps", 0, "training steps (0: the config's)", flag_values=FLAGS)
flags.DEFINE_integer("batch", 0, "sequences per step (0: the config's)", flag_values=FLAGS)
flags.DEFINE_integer("parallel", 4, "processes at a time", flag_values=FLAGS)
flags.DEFINE_float(
  "deadline_s",
  0,
  "seconds this call may take (0: none); processes stop with a checkpoint "
  "before it and resume on the next call",
  flag_values=FLAGS,
)
flags.DEFINE_float(
  "min_start_s",
  120,
  "with --deadline_s: no process starts with less than this left (a late "
  "one only slows the others and resumes on a later call)",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "tiny", False, "the config's CPU-sized variant (checks the study runs)", flag_values=FLAGS
)
flags.DEFINE_string(
  "out",
  os.path.join(os.environ["OUT"], "mqar_zoology") if os.environ.get("OUT") else "",
  "folder for zoology.json, commands.json and runs/ (empty: none)",
  flag_values=FLAGS,
)
flags.DEFINE_bool(
  "collect_only", False, "only collect finished sweeps into --out", flag_values=FLAGS
)
flags.DEFINE_string(
  "machine", "", "where the sweeps ran, recorded in commands.json", flag_values=FLAGS
)
flags.DEFINE_integer("resamples", stats.RESAMPLES, "bootstrap resamples", flag_values=FLAGS)
flags.DEFINE_list(
  "prior",
  [],
  "packs of earlier calls (e.g. docs/results/mqar_zoology): a sweep whose "
  "cells.json is there counts as done, and their commands.json calls are kept",
  flag_values=FLAGS,
)


def sweep_dir(root: str, width: int, mixer: str) -> str:
  return os.path.join(root, f"d{width}", mixer)


def plan(widths, mixers, lrs, seeds, num_steps, batch, tiny) -> dict:
  """The study's settings, checked before anything runs."""
  bad = [m for m in mixers if m not in zoo.MIXERS]
  if bad:
    raise app.UsageError(f"--mixers: unknown {bad}; expected names from {list(zoo.MIXERS)}")
  try:
    widths = [int(w) for w in widths]
    lrs = [float(x) for x in lrs]
    seeds = parse_seeds(seeds)
    for w in widths:
      zoo.parse_arg(f"d{w}")
  except (ValueError, ConfigError) as e:
    raise app.UsageError(f"--widths/--lrs/--seeds: {e}") from None
  if not lrs or any(lr <= 0 for lr in lrs) or len(set(lrs)) != len(lrs):
    raise app.UsageError(f"--lrs: expected distinct positive rates, got {lrs}")
  if not seeds:
    raise app.UsageError("--seeds: give at least one seed")
  if num_steps < 0 or batch < 0:
    raise app.UsageError("--num_steps and --batch must be >= 0 (0: the config's)")
  base = zoo.get_config(f"d{widths[0]},{mixers[0]}" + (",tiny" if tiny else ""))
  return {
    "widths": widths,
    "mixers": list(mixers),
    "lrs": lrs,
    "seeds": list(seeds),
    "tiny": tiny,
    "num_steps": num_steps or int(base.train.num_steps),
    "batch": batch or int(base.data.global_batch_size),
    "test_cells": [list(c) for c in zoo.test_cells(tiny)],
    "validation_examples": zoo.TINY["validation_examples"] if tiny else zoo.VALIDATION_EXAMPLES,
    "test_examples": zoo.TINY["test_examples"] if tiny else zoo.TEST_EXAMPLES,
  }


def sweep_command(p: dict, root: str, width: int, mixer: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "experiments.studies.mqar_zoology_sweep",
    f"--config=configs/mqar_zoology.py:d{width},{mixer}" + (",tiny" if p["tiny"] else ""),
    f"--workdir={sweep_dir(root, width, mixer)}",
    f"--config.train.lr_sweep=({','.join(repr(lr) for lr in p['lrs'])},)",
    f"--config.train.seeds={','.join(str(s) for s in p['seeds'])}",
    f"--config.train.num_steps={p['num_steps']}",
    f"--config.data.global_batch_size={p['batch']}",
    f"--test_cells={','.join(f'{t}:{n}' for t, n in p['test_cells'])}",
    f"--validation_examples={p['validation_examples']}",
    f"--test_examples={p['test_examples']}",
  ]


def record_path(p: dict, root: str, width: int, mixer: str) -> str | None:
  """The sweep's cells.json (in its workdir, else in a --prior pack) when it was made with the requested
  steps, batch, rates and seeds."""
  for folder in [sweep_dir(root, width, mixer)] + [
    os.path.join(x, "runs", f"d{width}", mixer) for x in p.get("prior", [])
  ]:
    path = os.path.join(folder, CELLS_FILE)
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    members = sorted((m["learning_rate"], m["seed"]) for m in rec["members"])
    if (rec["num_steps"], rec["batch"]) == (p["num_steps"], p["batch"]) and members == sorted(
      (lr, s) for lr in p["lrs"] for s in p["seeds"]
    ):
      return path
  return None


def load_record(p: dict, root: str, width: int, mixer: str) -> dict | None:
  path = record_path(p, root, width, mixer)
  if path is None:
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def study_jobs(p: dict, root: str) -> list[jobs_lib.Job]:
  out = []
  for mixer in p["mixers"]:
    for width in p["widths"]:
      wd = sweep_dir(root, width, mixer)
      out.append(
        jobs_lib.Job(
          f"d{width}/{mixer}",
          sweep_command(p, root, width, mixer),
          os.path.join(wd, "sweep.log"),
          done=lambda w=width, m=mixer: load_record(p, root, w, m) is not None,
        )
      )
  return out


def protocol(p: dict) -> str:
  c = zoo.get_config(f"d{p['widths'][0]},{p['mixers'][0]}" + (",tiny" if p["tiny"] else ""))
  return (
    f"{p['num_steps']} steps of {p['batch']} sequences per member (AdamW, weight decay "
    f"{c.optim.weight_decay}, warm-up {p['num_steps'] // 10} steps, cosine to {c.optim.min_lr_ratio} x "
    f"the rate); training rows from the cells {c.data.mqar.mixture} (<length>:<pairs>:<weight>), each "
    f"padded to {c.data.seq_len}; vocabulary {c.data.mqar.vocab_size}; {c.model.num_layers} layers of "
    f"{c.model.num_heads} heads (short convolutions + mixer + SwiGLU matched to kdn_diag's parameters); "
    f"rates {', '.join(f'{lr:g}' for lr in p['lrs'])} x seeds {', '.join(map(str, p['seeds']))} in one "
    f"vmapped process per width and mixer. Accuracy = the fraction of query values recalled "
    f"(teacher-forced argmax) on {p['test_examples']} test examples per cell; the rate is chosen per width "
    f"and mixer on {p['validation_examples']} validation examples per cell (another generator seed)."
  )


def collect(p: dict, root: str, out: str, call: dict, resamples: int):
  records, status = {}, {}
  for mixer in p["mixers"]:
    for width in p["widths"]:
      rec = load_record(p, root, width, mixer)
      wd = sweep_dir(root, width, mixer)
      if rec is None:
        status[f"d{width}/{mixer}"] = jobs_lib.last_outcome(os.path.join(wd, "sweep.log"))
        continue
      records[(width, mixer)] = rec
      status[f"d{width}/{mixer}"] = "completed"
      src = os.path.dirname(record_path(p, root, width, mixer))
      dest = os.path.join(out, "runs", f"d{width}", mixer)
      os.makedirs(dest, exist_ok=True)
      for name in (CELLS_FILE, "summary.json"):
        if os.path.exists(os.path.join(src, name)) and os.path.realpath(src) != os.path.realpath(
          dest
        ):
          shutil.copyfile(os.path.join(src, name), os.path.join(dest, name))
  result = stats.analyse(records, resamples=resamples) if records else {}
  write_json(
    os.path.join(out, "zoology.json"),
    dict(
      result,
      plan=p,
      status=status,
      protocol=protocol(p),
      test_cells=[stats.cell_key(*c) for c in p["test_cells"]],
    ),
  )
  path = os.path.join(out, "commands.json")
  cmds = {}
  for src in [path] + [os.path.join(x, "commands.json") for x in p.get("prior", [])]:
    if os.path.exists(src):  # this pack's calls, else the earlier pack's
      with open(src, encoding="utf-8") as f:
        cmds = json.load(f)
      break
  cmds["calls"] = cmds.get("calls", []) + [call]
  if call.get("machine") or "machine" not in cmds:
    cmds["machine"] = call.get("machine", "")
  cmds["study"] = call["command"]
  cmds["sweep"] = (
    " ".join(["python"] + sweep_command(p, "<runs>", 0, "<mixer>")[1:])
    .replace("d0,<mixer>", "d<width>,<mixer>")
    .replace("/d0/", "/d<width>/")
  )
  write_json(path, cmds)
  done = sum(v == "completed" for v in status.values())
  print(f"collected {done}/{len(status)} completed sweeps into {out}/zoology.json", flush=True)
  for c in result.get("comparisons", []):
    print(
      f"d{c['width']} {c['a']} - {c['b']}: "
      + ", ".join(
        f"{r['cell']} {r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] {r['verdict']}"
        for r in c["cells"]
      ),
      flush=True,
    )


def main(argv):
  del argv
  t0 = time.time()
  p = plan(
    FLAGS.widths, FLAGS.mixers, FLAGS.lrs, FLAGS.seeds, FLAGS.num_steps, FLAGS.batch, FLAGS.tiny
  )
  missing = [x for x in FLAGS.prior if not os.path.isdir(x)]
  if missing:
    raise app.UsageError(f"--prior: no folder {missing[0]!r} (give packs written by --out)")
  p["prior"] = list(FLAGS.prior)
  status = {}
  if not FLAGS.collect_only:
    status = jobs_lib.run_jobs(
      study_jobs(p, FLAGS.runs),
      FLAGS.parallel,
      FLAGS.deadline_s,
      min_start_s=FLAGS.min_start_s,
      env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
    )
  if FLAGS.out:
    call = {
      "command": " ".join(["python -m experiments.studies.mqar_zoology"] + sys.argv[1:]),
      "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
      "wall_s": round(time.time() - t0, 1),
      "jobs": status,
      "machine": FLAGS.machine,
    }
    collect(p, FLAGS.runs, FLAGS.out, call, FLAGS.resamples)
