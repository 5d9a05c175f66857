"""Runs `python -m experiments.train` on many command lines, each in its own process, with the
imports paid once: this process imports experiments.train (and jax, flax, the model configs, as
every run of it does) and then forks one child per command line, which sets sys.argv and runs the
module's absl app exactly as `python -m experiments.train` does. Prints one JSON line per command
line: {"argv": [...], "returncode": int, "stderr": str, "stdout": str}.

    python tests/train_cli_batch.py '<json list of argv lists>'

A case may instead be {"argv": [...], "fsize_limit": bytes}: the child then runs with that
RLIMIT_FSIZE (SIGXFSZ ignored), so writing a larger file fails as on a full disk.

(tests/runner/test_cli_values.py checks that a child's result equals a fresh process's.)
"""

import json
import os
import sys
import tempfile


def _run_child(argv, out_path, err_path, fsize_limit=None):
  """In the forked child: the script's stdout/stderr to files, then the app; never returns."""
  code = 1
  try:
    if fsize_limit:
      import resource  # pylint: disable=g-import-not-at-top
      import signal  # pylint: disable=g-import-not-at-top

      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(
        resource.RLIMIT_FSIZE, (fsize_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
      )
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    from absl import app  # pylint: disable=g-import-not-at-top

    from experiments import train  # pylint: disable=g-import-not-at-top

    sys.argv = ["experiments/train.py", *argv]
    app.run(train.main, flags_parser=train._parse_flags)  # pylint: disable=protected-access
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    code = 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def main():
  cases = json.loads(sys.argv[1])
  # what every run imports (the trainer's modules too), once
  import configs.mqar  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (warms the model configs)
  from experiments import train  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from experiments.runner import lr_sweep  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

  tmp = tempfile.mkdtemp()
  for i, case in enumerate(cases):
    argv, limit = (
      (case["argv"], case.get("fsize_limit")) if isinstance(case, dict) else (case, None)
    )
    out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
    pid = os.fork()
    if pid == 0:
      _run_child(argv, out_path, err_path, limit)
    _, status = os.waitpid(pid, 0)
    with open(out_path, encoding="utf-8") as f:
      stdout = f.read()
    with open(err_path, encoding="utf-8") as f:
      stderr = f.read()
    print(
      json.dumps(
        {
          "argv": argv,
          "returncode": os.waitstatus_to_exitcode(status),
          "stdout": stdout,
          "stderr": stderr,
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  main()
