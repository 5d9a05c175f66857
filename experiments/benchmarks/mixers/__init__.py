"""The mixers benchmark: ``python -m experiments.benchmarks.mixers`` (cli.py has the usage)."""
