"""Training entry point.

    python -m experiments.train --config=configs/mqar.py:smoke --workdir=/tmp/kdn_mqar_smoke
    python -m experiments.train --flagfile=configs/mqar.flags --config.train.num_steps=100
    python -m experiments.train --config=configs/mqar.py:smoke --config.model.num_layers=4 --workdir=...

The config is locked: overriding a key that does not exist fails at start naming the key; invalid values fail
validation (experiments/config_checks.py) before anything is built. Re-running with the same --workdir resumes
from the latest checkpoint.
"""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import config_checks, schema

# Every configuration mistake (config file, config arg, unknown key, bad value, missing or malformed data,
# a workdir holding another run) exits with this code after one 'Config error: ...' line on stderr.
CONFIG_ERROR_EXIT = 2
# A checkpoint that could not be written (a full disk): one 'Checkpoint error: ...' line; the workdir
# keeps its last complete checkpoint and the same command resumes from it.
SAVE_ERROR_EXIT = 3


def _config_error(msg: str):
  print(f"Config error: {msg}", file=sys.stderr, flush=True)
  sys.exit(CONFIG_ERROR_EXIT)


def _define_config_flag():
  # (config_flags expands the command line's --flagfile files while defining the flag)
  try:
    return config_flags.DEFINE_config_file(
      "config", None, "Experiment config file (configs/<name>.py[:arg]).", lock_config=True
    )
  except flags.CantOpenFlagFileError as e:
    _config_error(_flagfile_problem(e))


def _check_workdir(workdir: str):
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    _config_error(f"--workdir={workdir}: is a file; expected a directory (new or holding a run)")
  parent = os.path.dirname(os.path.abspath(workdir))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    _config_error(f"--workdir={workdir}: {parent} is a file; expected a directory path")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Progress lines go to stdout; library INFO logs (orbax's per-save lines) need --verbosity=0.
    logging.set_verbosity(logging.WARNING)
  try:
    # keys, values and data files before jax starts (the Trainer checks the mesh)
    config = config_checks.check(_CONFIG.value)
  except FileNotFoundError as e:  # a data file
    _config_error(str(e))
  except (OSError, schema.ConfigError) as e:  # OSError: get_config's deferred load failure
    _config_error(_root_message(e))
  _check_workdir(_WORKDIR.value)
  from experiments.runner import (
    checkpoint,  # pylint: disable=g-import-not-at-top
    lr_sweep,  # pylint: disable=g-import-not-at-top(imports jax)
  )

  try:
    tr = lr_sweep.make_trainer(config, _WORKDIR.value)
  except (schema.ConfigError, FileNotFoundError, checkpoint.CheckpointMismatchError) as e:
    _config_error(str(e))
  try:
    summary = tr.run()
  except (
    checkpoint.CheckpointMismatchError
  ) as e:  # raised at the start of run(), before any training
    _config_error(str(e))
  except checkpoint.CheckpointSaveError as e:
    print(f"Checkpoint error: {e}", file=sys.stderr, flush=True)
    return SAVE_ERROR_EXIT
  finally:
    tr.close()
  logging.info("summary: %s", summary)  # also in <workdir>/summary.json
  return 0 if summary["status"] in ("completed", "preempted") else 1


def _flagfile_problem(e: BaseException) -> str:
  """The one line for a --flagfile that cannot be read (found at import or at flag parsing)."""
  cause = next((c for c in _chain(e) if isinstance(c, OSError) and c.filename), None)
  if cause is None:
    return f"--flagfile: {_root_message(e)}"
  return f"--flagfile: cannot read {cause.filename!r} ({cause.strerror})"


def _root_message(e: BaseException) -> str:
  """The first line of the innermost ConfigError (or else the innermost error) behind ``e``: absl and
  ml_collections re-wrap errors raised while loading a config file, adding tracebacks."""
  chain = _chain(e)
  configs = [
    c
    for c in chain
    if isinstance(c, schema.ConfigError) and not str(c).startswith("Error whilst parsing")
  ]
  root = configs[-1] if configs else chain[-1]
  lines = str(root).strip().splitlines() or [""]
  return lines[0] if configs else f"{type(root).__name__}: {lines[-1]}"


def _expanded_args(argv) -> list[str]:
  """The command line with --flagfile contents inlined (absl reports an unreadable flagfile itself)."""
  try:
    return flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:
    return argv[1:]


def _config_file_problem(argv) -> str | None:
  """A message when the --config file (also from --flagfile) does not exist, naming what does."""
  values = [a.split("=", 1)[1] for a in _expanded_args(argv) if a.startswith("--config=")]
  if not values:
    return None
  spec = values[-1]
  path = spec.split(":", 1)[0]
  if os.path.isfile(path):
    return None
  folder = os.path.dirname(path) or "."
  found = sorted(
    os.path.join(os.path.dirname(path), f)
    for f in (os.listdir(folder) if os.path.isdir(folder) else [])
    if f.endswith(".py") and not f.startswith("_")
  )
  return f"--config: no config file {path!r}{'' if spec == path else f' (in {spec!r})'}; " + (
    f"available: {', '.join(found)}" if found else f"no .py config files in {folder!r}"
  )


def _parse_flags(argv):
  """absl flag parsing with one 'Config error:' line naming the config file, arg token or key that could not
  be used."""
  problem = _config_file_problem(argv)
  if problem:
    _config_error(problem)
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    if any(isinstance(c, flags.CantOpenFlagFileError) for c in _chain(e)):
      _config_error(_flagfile_problem(e))
    msg = _root_message(e)
    if any(isinstance(c, schema.ConfigError) for c in _chain(e)):
      _config_error(msg)
    # An override of a key the locked config lacks surfaces as a KeyError/AttributeError (or absl's unknown
    # flag) whose text holds the key's last component.
    lookup = [
      c for c in _chain(e) if isinstance(c, (AttributeError, KeyError, flags.UnrecognizedFlagError))
    ]
    overrides = [a.split("=")[0][2:] for a in _expanded_args(argv) if a.startswith("--config.")]
    named = [
      o
      for o in overrides
      if any(re.search(rf"\b{re.escape(o.split('.')[-1])}\b", str(c)) for c in lookup)
    ]
    if named:
      _config_error(
        f"unknown config key {named[0]!r}{schema.did_you_mean(named[0])} (configs are "
        "locked; see experiments/schema.py for the schema)"
      )
    bad_flag = re.match(
      r"flag --([\w.]+)=(.*?): ", str(e)
    )  # absl's prefix names the flag and its value
    _config_error(f"--{bad_flag[1]}={bad_flag[2]}: {msg}" if bad_flag else msg)


def _chain(e) -> list[BaseException]:
  """``e`` and the errors it was raised from or while handling, outermost first."""
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


_CONFIG = _define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summaries.")
flags.mark_flags_as_required(["config", "workdir"])


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
