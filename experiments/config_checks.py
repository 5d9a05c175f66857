"""The checks a run config gets before anything is built, done once per config.

:func:`check` fills the token-file keys from ``data.corpus_dir``, then checks the keys, every value
(experiments/schema.py) and the token files the run will read. ``experiments/train.py`` calls it
before jax starts; the Trainer calls it again for studies and tests that build one directly, and a
config whose content already passed is not checked a second time (so a command line's config is
checked once, and a config changed after its check is checked again). What needs the devices (the
mesh, the batch and length splits) is checked by the Trainer alone (``schema.check_mesh``).
"""

from __future__ import annotations

import collections

from experiments import schema
from experiments.data import corpus, token_files

# content of the configs that passed, newest last (a study process checks a few hundred at most)
_PASSED: collections.OrderedDict[str, None] = collections.OrderedDict()
_REMEMBERED = 512


def _content(config) -> str:
  return config.to_json_best_effort(sort_keys=True)


def check(config):
  """Raises ConfigError (FileNotFoundError for a missing data file) naming the first bad key, unless
  a config of the same content passed already; returns ``config``, its corpus paths filled in."""
  if _content(config) in _PASSED:
    return config
  schema.check_keys(config)
  if config.data.kind == "token_file":  # corpus_dir fills the paths and eos_id the checks read
    corpus.resolve(config)
  schema.check_values(config)
  token_files.check_run_files(config)
  _PASSED[_content(config)] = None
  while len(_PASSED) > _REMEMBERED:
    _PASSED.popitem(last=False)
  return config
