"""The study driver's command line and launcher: every study takes the common flags from one
definition, its plan is made from the flags its arguments name, bad flags end in one line before
any work, and the parallel arms' launcher (jobs.run_jobs) makes a command as a job starts, echoes
the lines asked for, reads a job's exit code as its outcome and leaves a job that stops itself to
its own deadline."""

from __future__ import annotations

import sys

import pytest

from experiments.studies import jobs, study_driver, study_plan
from experiments.studies.lengen_map import study as lengen_map
from experiments.studies.lengen_synthetic import study as lengen_synthetic
from experiments.studies.lengen_text import study as lengen_text
from experiments.studies.passkey import study as passkey

STUDIES = (passkey, lengen_text, lengen_synthetic, lengen_map)
COMMON = (  # --preset too, its help naming each study's presets
  "strategies",
  "workdir",
  "publish",
  "parallel",
  "deadline_s",
  "machine",
  "override",
  "child",
)


def test_every_study_takes_the_common_flags_from_one_definition():
  def help_text(s, name):  # the help with the study's name and unit written generically
    name_of = study_plan.study_name(s.STUDY)
    return s.FLAGS[name].help.replace(name_of, "<study>").replace(s.STUDY.unit, "<unit>")

  for name in COMMON:
    helps = {s.__name__: help_text(s, name) for s in STUDIES}
    assert len(set(helps.values())) == 1, (name, helps)
  for name, (_, default, text) in study_driver.SHARED_FLAGS.items():
    takers = [s for s in STUDIES if name in s.FLAGS]
    assert takers, f"{name}: no study takes it"
    assert all(s.FLAGS[name].help == text and s.FLAGS[name].default == default for s in takers)
  for s in STUDIES:
    assert s.FLAGS["preset"].default == s.PRESETS[0] == "tiny"
    assert f"{s.STUDY.unit}s" in s.FLAGS  # the arms' flag: --<unit>s


@pytest.fixture
def passkey_flags(monkeypatch):
  def parse(*args):
    monkeypatch.setattr(sys, "argv", ["passkey", *args])
    passkey.FLAGS.unparse_flags()
    passkey.FLAGS(sys.argv)
    return passkey.FLAGS

  yield parse
  passkey.FLAGS.unparse_flags()


def test_the_plan_is_made_from_the_flags_its_arguments_name(passkey_flags, tmp_path):
  f = passkey_flags("--arms=kda.s3", "--override=model.num_layers=1", f"--workdir={tmp_path}")
  plan = study_driver.plan_from_flags(passkey.Plan, f)
  assert plan.arms == ("kda.s3",) and plan.overrides == {"model.num_layers": 1}
  assert plan.workdir == str(tmp_path) and plan.config("kda.s3", "pretrain").model.num_layers == 1


def test_bad_flags_end_in_one_line_before_any_work(passkey_flags, tmp_path, capsys):
  def run(*args):
    f = passkey_flags(*args, f"--workdir={tmp_path / 'w'}")
    code = study_driver.main(passkey.STUDY, f, passkey.Plan, protocol=None, table=None)
    return code, capsys.readouterr().err.strip().splitlines()

  assert run("--arms=lstm.s0") == (
    2,
    [f"Study error: --arms: expected <mixer>.s<seed> with a mixer from {passkey.arm_mixers()}, "
     "got 'lstm.s0'"],
  )  # fmt: skip
  code, err = run("--override=model.depth=3")
  assert code == 2 and err == ["Study error: --override: unknown config key 'model.depth'"]
  assert not (tmp_path / "w").exists()


def test_the_launcher_runs_children_that_stop_themselves(tmp_path):
  # a child prints a shown and a hidden line, sleeps, touches a marker and exits with its code
  (tmp_path / "child.py").write_text(
    "import sys, time\n"
    'print("study: shown", flush=True)\nprint("hidden", flush=True)\n'
    'time.sleep(float(sys.argv[2]))\nopen(sys.argv[3], "w").close()\nsys.exit(int(sys.argv[1]))\n'
  )
  made = []

  def job(name, rc, sleep_s):
    def command():  # made as the job starts
      made.append(name)
      return [
        sys.executable,
        str(tmp_path / "child.py"),
        str(rc),
        str(sleep_s),
        str(tmp_path / name),
      ]

    show = lambda line: line.startswith("study:")
    return jobs.Job(name, command, str(tmp_path / f"{name}.log"), None, None, show)

  def run(job_list, deadline_s):
    with open(tmp_path / "out.txt", "w", encoding="utf-8") as out:
      got = jobs.run_jobs(job_list, 1, deadline_s, save_s=0, kill_s=None, min_start_s=0, out=out)
    return got, (tmp_path / "out.txt").read_text().splitlines()

  status, lines = run([job("a", 0, 0.1), job("b", 3, 0.1)], 30)
  assert status == {"a": "done", "b": "exit 3"} and made == ["a", "b"]
  assert "[a] study: shown" in lines and "[b] study: shown" in lines
  assert not any("hidden" in line for line in lines)
  # past the deadline a child is left to stop itself (no signal): it ends on its own, stopped
  status, _ = run([job("late", 3, 1.0)], 0.3)
  assert status == {"late": "stopped"} and (tmp_path / "late").exists()
