"""``python -m experiments.studies.lengen_map``: study.py's main, with its own flags."""

from absl import app

from experiments.runner import cli
from experiments.studies.lengen_map.study import FLAGS, main

if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
