"""The noise factorial at mu = K and the fixed-weight beta_eff probe (configs/noise_factorial.py).

    python -m experiments.studies.noise_factorial --corpus=<corpus> --runs=/tmp/noise --deadline_s=540 \\
        --out=$OUT/noise_factorial

Training: one process per noise mode (``learned``: r and omega learned, the default; ``fixed_r``: r = 1;
``fixed``: r = omega = 1), each training its seeds at once. Evaluation of every member:
``experiments.evaluate --suite=ppl,beta_eff``; and of the ``learned`` members (the trained mu = K model) the
fixed-weight probe, ``--suite=beta_eff --override_info_scale=<mu>`` for mu in 1, sqrt(K), K, 4K (the same
parameters, mu replaced). Calling again resumes (finished trainings and evaluations are skipped);
``--deadline_s`` stops the trainings with a checkpoint before it. ``--out`` (default
``$OUT/noise_factorial``) gets ``noise.json`` (per mode and seed: validation perplexity, mean beta_eff;
the probe per seed and mu) and ``commands.json``.
"""

from __future__ import annotations

import glob
import os
import sys
import time

from absl import app, flags

from experiments.runner import cli
from experiments.runner.logging_utils import write_json
from experiments.schema import ConfigError, parse_seeds
from experiments.studies import jobs as jobs_lib
from experiments.studies.study_driver import read_json

MODES = ("learned", "fixed_r", "fixed")
PROBE = ("1", "sqrt_k", "k", "4k")

FLAGS = flags.FlagValues()
flags.DEFINE_string("runs", "workdirs/noise_factorial", "root of the workdirs", flag_values=FLAGS)
flags.DEFINE_string(
  "corpus", "", "the prepared corpus (experiments/data/prepare.py --out)", flag_values=FLAGS
)
flags.DEFINE_list("modes", list(MODES), "noise modes", flag_values=FLAGS)
flags.DEFINE_string("seeds", "0,1", "seeds trained at once per mode", flag_values=FLAGS)
flags.DEFINE_integer("num_steps", 0, "training steps (0: the config's)", flag_values=FLAGS)
flags.DEFINE_list("probe", list(PROBE), "mu values of the fixed-weight probe", flag_values=FLAGS)
flags.DEFINE_integer("parallel", 3, "processes at a time", flag_values=FLAGS)
flags.DEFINE_float("deadline_s", 0, "seconds this call may take (0: none)", flag_values=FLAGS)
flags.DEFINE_bool("smoke", False, "the tiny CPU preset", flag_values=FLAGS)
flags.DEFINE_string(
  "out",
  os.path.join(os.environ["OUT"], "noise_factorial") if os.environ.get("OUT") else "",
  "folder for noise.json and commands.json (empty: none)",
  flag_values=FLAGS,
)
flags.DEFINE_bool("collect_only", False, "only collect finished runs into --out", flag_values=FLAGS)
flags.DEFINE_string(
  "machine", "", "where the runs ran, recorded in commands.json", flag_values=FLAGS
)


def member_dir(root: str, mode: str, seed: int) -> str:
  """The member folder of ``seed`` (named by the preset's one learning rate: lr<rate>_seed<seed>)."""
  found = sorted(glob.glob(os.path.join(root, mode, f"lr*_seed{seed}")))
  return found[0] if found else os.path.join(root, mode, f"lr<rate>_seed{seed}")


def trained(root: str, mode: str, seeds) -> bool:
  return all(
    (read_json(os.path.join(member_dir(root, mode, s), "summary.json")) or {}).get("status")
    == "completed"
    for s in seeds
  )


def train_job(root, mode, seeds, corpus, num_steps, smoke) -> jobs_lib.Job:
  cmd = [
    sys.executable,
    "-m",
    "experiments.train",
    f"--config=configs/noise_factorial.py:{mode}" + (",smoke" if smoke else ""),
    f"--config.data.corpus_dir={corpus}",
    f"--config.train.seeds={','.join(map(str, seeds))}",
    f"--workdir={os.path.join(root, mode)}",
  ] + ([f"--config.train.num_steps={num_steps}"] if num_steps else [])
  return jobs_lib.Job(
    f"train {mode}",
    cmd,
    os.path.join(root, mode, "train.log"),
    done=lambda: trained(root, mode, seeds),
    stop_flag=None,
  )


def _evaluated(out_dir: str, suites, step) -> bool:
  return all(
    (read_json(os.path.join(out_dir, f"{s}.json")) or {}).get("meta", {}).get("step") == step
    for s in suites
  )


def eval_jobs(root, modes, seeds, probe) -> list[jobs_lib.Job]:
  """ppl + beta_eff of every trained member; the mu probe of the learned-noise members."""
  out = []
  for mode in modes:
    for s in seeds:
      wd = member_dir(root, mode, s)
      summary = read_json(os.path.join(wd, "summary.json")) or {}
      if summary.get("status") != "completed":
        continue
      step = summary["step"]
      base = [sys.executable, "-m", "experiments.evaluate", f"--workdir={wd}"]
      plain = os.path.join(wd, "eval")
      out.append(
        jobs_lib.Job(
          f"eval {mode}/seed{s}",
          base + ["--suite=ppl,beta_eff"],
          os.path.join(wd, "eval.log"),
          stop_flag=None,
          done=lambda d=plain, st=step: _evaluated(d, ("ppl", "beta_eff"), st),
        )
      )
      if mode != "learned":
        continue
      for mu in probe:
        probed = os.path.join(wd, "eval", f"info_scale_{mu}")
        out.append(
          jobs_lib.Job(
            f"probe seed{s} mu={mu}",
            base + ["--suite=beta_eff", f"--override_info_scale={mu}"],
            os.path.join(wd, f"probe_{mu}.log"),
            stop_flag=None,
            done=lambda d=probed, st=step: _evaluated(d, ("beta_eff",), st),
          )
        )
  return out


def _spread(values) -> dict:
  return (
    {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}
    if values
    else None
  )


def collect(root, modes, seeds, probe) -> dict:
  res = {"modes": {}, "probe": {"seeds": {}, "mu": list(probe)}}
  for mode in modes:
    rows = {}
    for s in seeds:
      wd = member_dir(root, mode, s)
      ppl, beta = (
        read_json(os.path.join(wd, "eval", "ppl.json")),
        read_json(os.path.join(wd, "eval", "beta_eff.json")),
      )
      if ppl and beta:
        rows[str(s)] = {
          "step": beta["meta"]["step"],
          "perplexity": ppl["perplexity"],
          "beta_eff": beta["all"]["mean"],
          "beta_eff_layers": [beta["layers"][str(i)]["mean"] for i in range(len(beta["layers"]))],
        }
      if mode == "learned":
        got = {
          mu: (read_json(os.path.join(wd, "eval", f"info_scale_{mu}", "beta_eff.json")) or {})
          .get("all", {})
          .get("mean")
          for mu in probe
        }
        if all(v is not None for v in got.values()):
          res["probe"]["seeds"][str(s)] = got
    res["modes"][mode] = {
      "seeds": rows,
      "perplexity": _spread([r["perplexity"] for r in rows.values()]),
      "beta_eff": _spread([r["beta_eff"] for r in rows.values()]),
    }
  ps = res["probe"]["seeds"]
  res["probe"]["mean"] = (
    {mu: sum(v[mu] for v in ps.values()) / len(ps) for mu in probe} if ps else {}
  )
  return res


def main(argv):
  del argv
  t0 = time.time()
  bad = [m for m in FLAGS.modes if m not in MODES]
  if bad:
    raise app.UsageError(f"--modes: unknown {bad}; expected names from {list(MODES)}")
  try:
    seeds = parse_seeds(FLAGS.seeds)
  except ConfigError as e:
    raise app.UsageError(f"--seeds: {e}") from None
  if not seeds:
    raise app.UsageError("--seeds: give at least one seed")
  if not FLAGS.collect_only and not (FLAGS.corpus and os.path.isdir(FLAGS.corpus)):
    raise app.UsageError(
      f"--corpus: a prepared corpus folder is needed, got {FLAGS.corpus!r} (python -m "
      "experiments.data.prepare --out=<corpus>)"
    )
  status = {}
  if not FLAGS.collect_only:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    train = [
      train_job(FLAGS.runs, m, seeds, FLAGS.corpus, FLAGS.num_steps, FLAGS.smoke)
      for m in FLAGS.modes
    ]
    # SIGTERM well before the end: the trainer's checkpoint of a 30M model and two seeds takes a while
    status.update(jobs_lib.run_jobs(train, FLAGS.parallel, FLAGS.deadline_s, kill_s=45, env=env))
    left = FLAGS.deadline_s - (time.time() - t0) if FLAGS.deadline_s else 0
    if not FLAGS.deadline_s or left > 90:
      status.update(
        jobs_lib.run_jobs(
          eval_jobs(FLAGS.runs, FLAGS.modes, seeds, FLAGS.probe),
          max(FLAGS.parallel, 4),
          left,
          min_start_s=60,
          env=env,
        )
      )
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    res = collect(FLAGS.runs, FLAGS.modes, seeds, FLAGS.probe)
    res["status"] = {
      m: "completed"
      if trained(FLAGS.runs, m, seeds)
      else jobs_lib.last_outcome(os.path.join(FLAGS.runs, m, "train.log"))
      for m in FLAGS.modes
    }
    write_json(os.path.join(FLAGS.out, "noise.json"), res)
    path = os.path.join(FLAGS.out, "commands.json")
    cmds = read_json(path) or {}
    call = {
      "command": " ".join(["python -m experiments.studies.noise_factorial"] + sys.argv[1:]),
      "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
      "wall_s": round(time.time() - t0, 1),
      "jobs": status,
      "machine": FLAGS.machine,
    }
    cmds["calls"] = cmds.get("calls", []) + [call]
    if FLAGS.machine or "machine" not in cmds:
      cmds["machine"] = FLAGS.machine
    cmds["train"] = (
      "python -m experiments.train --config=configs/noise_factorial.py:<noise> "
      "--config.data.corpus_dir=<corpus> --workdir=<runs>/<noise>   (noise in learned, fixed_r, "
      f"fixed; seeds {','.join(map(str, seeds))} trained at once)"
    )
    cmds["evaluate"] = (
      "python -m experiments.evaluate --workdir=<runs>/<noise>/lr<rate>_seed<s> --suite=ppl,beta_eff"
    )
    cmds["probe"] = (
      "python -m experiments.evaluate --workdir=<runs>/learned/lr<rate>_seed<s> --suite=beta_eff "
      "--override_info_scale=<mu>   (mu in " + ", ".join(FLAGS.probe) + ")"
    )
    write_json(path, cmds)
    print(
      f"wrote {FLAGS.out}/noise.json: "
      + "; ".join(f"{m}: {res['status'][m]}" for m in FLAGS.modes),
      flush=True,
    )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
