"""Training entry point.

    python -m experiments.train --config=configs/mqar.py:smoke --workdir=/tmp/kdn_mqar_smoke
    python -m experiments.train --flagfile=configs/mqar.flags --config.train.num_steps=100
    python -m experiments.train --config=configs/mqar.py:smoke --config.model.num_layers=4 --workdir=...

The config is locked: overriding a key that does not exist fails at start naming the key; invalid values fail
validation (experiments/config_lib.py) before anything is built. Re-running with the same --workdir resumes
from the latest checkpoint.
"""
from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import config_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/<name>.py[:arg]).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and summaries.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    # Progress lines go to stdout; library INFO logs (orbax's per-save lines) need --verbosity=0.
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  try:
    config_lib.check_keys(config)
  except config_lib.ConfigError as e:
    print(f'Config error: {e}', file=sys.stderr)
    return 2
  from experiments import trainer  # pylint: disable=g-import-not-at-top  (imports jax)
  try:
    tr = trainer.Trainer(config, _WORKDIR.value)
  except (config_lib.ConfigError, FileNotFoundError) as e:
    print(f'Config error: {e}', file=sys.stderr)
    return 2
  try:
    summary = tr.run()
  finally:
    tr.close()
  logging.info('summary: %s', summary)  # also in <workdir>/summary.json
  return 0 if summary['status'] in ('completed', 'preempted') else 1


def _parse_flags(argv):
  """absl flag parsing with a one-line error naming the config key that could not be applied."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    msg = str(e).strip('\'"')
    overrides = [a.split('=')[0] for a in argv[1:] if a.startswith('--config.')]
    named = [o for o in overrides if msg and msg.split()[0].strip('\'"') in o]
    if isinstance(e, (AttributeError, KeyError)) and named:
      sys.exit(f'Config error: unknown config key {named[0][2:]!r} (configs are locked; see '
               'experiments/config_lib.py for the schema)')
    sys.exit(f'Config error: {type(e).__name__}: {msg}')


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
