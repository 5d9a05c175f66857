"""``python -m experiments.studies.passkey``: study.py's main, with its own flags."""

from absl import app

from experiments.runner import cli
from experiments.studies.passkey.study import FLAGS, main

if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
