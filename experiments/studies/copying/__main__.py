"""``python -m experiments.studies.copying``: study.py's main, with its own flags."""

from absl import app

from experiments.runner import cli
from experiments.studies.copying.study import FLAGS, main

if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
