"""Input pipelines: grain MapDatasets over token files and synthetic tasks, and the TBTT chunk stream."""

from experiments.data.pipeline import make_eval_batches, make_train_iterator  # noqa: F401
