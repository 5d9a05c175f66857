"""``python -m experiments.benchmarks.mixers``: the mixers benchmark's command line (cli.py)."""

from absl import app

from experiments.benchmarks.mixers import cli
from experiments.runner import cli as runner_cli

if __name__ == "__main__":
  app.run(cli.main, flags_parser=runner_cli.own_flags_parser(cli.FLAGS))
