"""The MQAR Zoology study: the verdict rule, the statistics on constructed sweeps (rate picked on the
validation split, the paired difference), the renderer reading verdicts from intervals only, the job
runner's deadline, and the tiny study end to end (train, score, collect, skip on a second call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.studies import jobs
from experiments.studies.mqar_zoology import render as mqar_results
from experiments.studies.mqar_zoology import stats
from tests.runner_helpers import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_verdict_rule():
  assert stats.verdict(0.01, 0.2) == "ahead"
  assert stats.verdict(-0.2, -0.01) == "behind"
  assert stats.verdict(-0.1, 0.1) == "tied"
  assert stats.verdict(0.0, 0.1) == "tied" and stats.verdict(-0.1, 0.0) == "tied"  # 0 inside: tied


def _record(mixer, val_acc, test_acc, n=4, examples=200, seed=0):
  """A cells.json record: rates {1e-3, 1e-2} x seeds {0, 1, 2}; per-example correct counts drawn with the
  given per-rate accuracies on one validation and one test cell."""
  rng = np.random.default_rng(seed)
  members = [
    {"learning_rate": lr, "seed": s, "status": "completed"}
    for lr in (1e-3, 1e-2)
    for s in (0, 1, 2)
  ]
  split = lambda acc: {
    "cells": [
      {
        "seq_len": 64,
        "num_kv_pairs": n,
        "correct": [rng.binomial(n, acc[m["learning_rate"]], examples).tolist() for m in members],
      }
    ]
  }
  return {
    "width": 64,
    "mixer": mixer,
    "num_params": 1,
    "step": 10,
    "num_steps": 10,
    "members": members,
    "validation": split(val_acc),
    "test": split(test_acc),
  }


def test_statistics_pick_the_rate_on_validation_and_pair_the_difference():
  # validation prefers 1e-3 for both mixers; the test split would prefer 1e-2 (never used to choose)
  a = _record("kdn_diag", {1e-3: 0.8, 1e-2: 0.3}, {1e-3: 0.7, 1e-2: 0.95}, seed=1)
  b = _record("kda", {1e-3: 0.6, 1e-2: 0.2}, {1e-3: 0.5, 1e-2: 0.99}, seed=2)
  z = stats.analyse({(64, "kdn_diag"): a, (64, "kda"): b}, resamples=500)
  assert (
    z["best"]["d64/kdn_diag"]["learning_rate"] == 1e-3
    and z["best"]["d64/kda"]["learning_rate"] == 1e-3
  )
  (cmp,) = z["comparisons"]
  (row,) = cmp["cells"]
  ta = np.asarray(a["test"]["cells"][0]["correct"])[:3] / 4
  tb = np.asarray(b["test"]["cells"][0]["correct"])[:3] / 4
  assert row["diff"] == pytest.approx((ta - tb).mean())
  assert row["lo"] < row["diff"] < row["hi"] and row["lo"] > 0 and row["verdict"] == "ahead"
  acc = z["cells"]["d64/kdn_diag"][0]
  assert acc["mean"] == pytest.approx(ta.mean()) and acc["lo"] < acc["mean"] < acc["hi"]


def test_renderer_reads_verdicts_from_the_intervals(tmp_path):
  rows = [  # (diff, lo, hi): point estimates that disagree with the intervals' verdicts
    ("64x4", 0.05, -0.01, 0.11),
    ("64x8", -0.002, 0.001, 0.02),
    ("128x32", 0.01, -0.03, -0.001),
  ]
  z = {
    "test_cells": [r[0] for r in rows],
    "protocol": "p",
    "status": {"d64/kdn_diag": "completed", "d64/kda": "stopped at step 5/10"},
    "best": {},
    "cells": {},
    "comparisons": [
      {
        "width": 64,
        "a": "kdn_diag",
        "b": "kda",
        "seeds": [0, 1, 2],
        "cells": [
          {"cell": c, "diff": d, "lo": lo, "hi": hi, "a": 0.5, "b": 0.5, "verdict": "stale"}
          for c, d, lo, hi in rows
        ],
      }
    ],
  }
  os.makedirs(tmp_path / "mqar_zoology")
  (tmp_path / "mqar_zoology" / "zoology.json").write_text(json.dumps(z))
  (tmp_path / "mqar_zoology" / "commands.json").write_text(
    json.dumps({"calls": [{"command": "c", "wall_s": 60}]})
  )
  md = mqar_results.render(str(tmp_path), str(tmp_path / "fig"))
  got = {
    line.split("|")[1].strip(): line.split("|")[-2].strip()
    for line in md.splitlines()
    if line.startswith(("| 64x", "| 128x"))
  }
  assert got == {"64x4": "tied", "64x8": "ahead", "128x32": "behind"}
  assert "**Mixed**" in md and "1 / 1 / 1" in md and "d64/kda: stopped at step 5/10" in md
  assert "**Not yet run.**" in mqar_results.render(str(tmp_path / "none"), str(tmp_path / "fig"))


def test_jobs_stop_before_the_deadline_and_do_not_start_late(tmp_path):
  # argv: <marker> --stop_at_time=<t> (the runner appends the stop flag)
  (tmp_path / "fake.py").write_text(
    'import sys, time\nstop = float(sys.argv[2].split("=")[1])\ni = 0\n'
    'while time.time() < stop:\n  i += 1\n  print(f"step {i}/1000", flush=True)\n  time.sleep(0.05)\n'
    'open(sys.argv[1], "w").write("stopped")\n'
  )
  mk = lambda name: jobs.Job(
    name,
    [sys.executable, str(tmp_path / "fake.py"), str(tmp_path / f"{name}.out")],
    str(tmp_path / f"{name}.log"),
  )
  status = jobs.run_jobs(
    [mk("a"), mk("b")],
    parallel=1,
    deadline_s=4,
    save_s=2,
    kill_s=0.5,
    min_start_s=3,
    progress_every_s=1,
  )
  assert status == {"a": "stopped", "b": "not started"}
  assert (
    tmp_path / "a.out"
  ).read_text() == "stopped"  # it stopped itself at its stop time, before a signal
  assert not (tmp_path / "b.out").exists() and jobs.last_step(str(tmp_path / "a.log"))[1] == 1000
  done = jobs.Job(
    "c", [sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path / "c.log"), done=lambda: True
  )
  assert jobs.run_jobs([done], parallel=1) == {"c": "already done"}


def test_tiny_study_end_to_end(tmp_path):
  """Two (width, mixer) sweeps of 2 rates x 2 seeds in parallel processes, scored, collected; a second
  call on a fresh machine, given the first call's pack, finds them done and only collects."""
  cmd = [
    sys.executable,
    "-m",
    "experiments.studies.mqar_zoology",
    f"--runs={tmp_path / 'runs'}",
    "--widths=16",
    "--mixers=kdn_diag,kda",
    "--lrs=0.003,0.01",
    "--seeds=0,1",
    "--tiny",
    "--parallel=2",
    f"--out={tmp_path / 'out'}",
  ]
  env = one_device_env()
  first = subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
  )
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  z = json.loads((tmp_path / "out" / "zoology.json").read_text())
  assert z["status"] == {"d16/kdn_diag": "completed", "d16/kda": "completed"}
  (cmp,) = z["comparisons"]
  assert [r["cell"] for r in cmp["cells"]] == ["16x2", "32x4", "32x8"] and cmp["seeds"] == [0, 1]
  for r in cmp["cells"]:
    assert r["lo"] <= r["diff"] <= r["hi"] and r["verdict"] == stats.verdict(r["lo"], r["hi"])
  rec = json.loads((tmp_path / "out" / "runs" / "d16" / "kda" / "cells.json").read_text())
  assert len(rec["members"]) == 4 and rec["step"] == 30
  for split, n in (("validation", 16), ("test", 24)):
    for c in rec[split]["cells"]:
      k = np.asarray(c["correct"])
      assert k.shape == (4, n) and k.min() >= 0 and k.max() <= c["num_kv_pairs"]
  # a later call on a fresh machine (no workdirs) with this pack as --prior: nothing to run, all collected
  second = subprocess.run(
    [
      c.replace(str(tmp_path / "runs"), str(tmp_path / "fresh")).replace(
        str(tmp_path / "out"), str(tmp_path / "out2")
      )
      for c in cmd
    ]
    + [f"--prior={tmp_path / 'out'}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert second.returncode == 0 and "2 already done, 0 to run" in second.stdout, second.stdout[
    -2000:
  ]
  z2 = json.loads((tmp_path / "out2" / "zoology.json").read_text())
  assert z2["comparisons"] == z["comparisons"]
  assert (tmp_path / "out2" / "runs" / "d16" / "kda" / "cells.json").exists()
  calls = json.loads((tmp_path / "out2" / "commands.json").read_text())["calls"]
  assert len(calls) == 2 and calls[1]["jobs"] == {
    "d16/kdn_diag": "already done",
    "d16/kda": "already done",
  }


def test_a_job_out_of_memory_is_retried_once_with_fewer_beside_it(tmp_path):
  # 'oom' fails with an out-of-memory message on its first run; 'other' runs beside it for a second
  (tmp_path / "oom.py").write_text(
    "import os, sys, time\nmark = sys.argv[1]\n"
    'if not os.path.exists(mark):\n  open(mark, "w").close()\n  print("RESOURCE_EXHAUSTED: Out of memory")\n'
    '  sys.exit(1)\nopen(mark + ".start", "w").write(repr(time.time()))\nopen(mark + ".done", "w").close()\n'
  )
  (tmp_path / "other.py").write_text(
    'import sys, time\ntime.sleep(1.5)\nopen(sys.argv[1], "w").write(repr(time.time()))\n'
  )
  oom = jobs.Job(
    "oom",
    [sys.executable, str(tmp_path / "oom.py"), str(tmp_path / "m")],
    str(tmp_path / "oom.log"),
    done=lambda: (tmp_path / "m.done").exists(),
    stop_flag=None,
  )
  other = jobs.Job(
    "other",
    [sys.executable, str(tmp_path / "other.py"), str(tmp_path / "o")],
    str(tmp_path / "other.log"),
    done=lambda: (tmp_path / "o").exists(),
    stop_flag=None,
  )
  status = jobs.run_jobs([oom, other], parallel=2)
  assert status == {"oom": "done", "other": "done"}
  # retried only once 'other' had finished: one job at a time after the failure
  assert float((tmp_path / "m.start").read_text()) >= float((tmp_path / "o").read_text())
  assert jobs.ran_out_of_memory(str(tmp_path / "oom.log"))
