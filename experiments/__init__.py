"""The experiment runner and evaluation of kdn_jax (configs -> experiments -> kdn_jax).

``experiments.load(workdir, step=None)`` restores a trained run (model, config, tokenizer):
see experiments/loading.py."""


def __getattr__(name):
  # lazy: `python -m experiments.data.prepare` and the CLIs' flag errors must not wait for jax
  if name == "load":
    from experiments.loading import load  # pylint: disable=g-import-not-at-top

    return load
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
