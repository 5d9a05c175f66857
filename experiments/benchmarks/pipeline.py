"""Throughput of the packed-document input pipeline (host CPU only; no model).

python -m experiments.benchmarks.pipeline --config=configs/lm_corpus.py:default --batches=1000
"""

from __future__ import annotations

import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/lm_corpus.py:default", "Run config.")
_BATCHES = flags.DEFINE_integer("batches", 1000, "Batches timed (after one warm-up batch).")


def main(argv):
  del argv
  from experiments.data import corpus, pipeline  # pylint: disable=g-import-not-at-top

  c = _CONFIG.value
  corpus.resolve(c)
  it = pipeline.make_train_iterator(c)
  next(it)
  t0 = time.time()
  docs = 0.0
  for _ in range(_BATCHES.value):
    b = next(it)
    if "segment_ids" in b:
      docs += float((b["segment_ids"].max(1) + 1).mean())
  dt = time.time() - t0
  tokens = _BATCHES.value * b["inputs"].size
  print(
    f"{tuple(b['inputs'].shape)} batches: {tokens / dt / 1e6:.2f}M tokens/s, {_BATCHES.value / dt:.0f} "
    f"batches/s, {docs / _BATCHES.value:.2f} documents per row"
  )


if __name__ == "__main__":
  app.run(main)
