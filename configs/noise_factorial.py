"""The noise factorial at the main information scale mu = K: diagonal KDN on the corpus LM preset of the mu
study (configs/lm_corpus.py:default), learning both noise terms r and omega (the default), fixing r = 1, or
fixing both at 1, two seeds each trained at once (``train.seeds``, experiments/runner/lr_sweep.py).

    python -m experiments.train --config=configs/noise_factorial.py:fixed_r \\
        --config.data.corpus_dir=<corpus> --workdir=/tmp/noise/fixed_r
    python -m experiments.studies.noise_factorial --corpus=<corpus> --runs=/tmp/noise --deadline_s=540

Arg ``<noise>[,smoke]``: ``learned`` | ``fixed_r`` | ``fixed`` (kdn_jax/layers/kdn_mixer.py); ``smoke`` is
the tiny CPU preset. The seed of each member sets its initial parameters and its data order.
"""

from configs import common, lm_corpus

NOISE_MODES = ("learned", "fixed_r", "fixed")
SEEDS = "0,1"


def get_config(arg: str = "learned"):
  parts = [p for p in (arg or "learned").split(",") if p]
  mode, smoke = parts[0], "smoke" in parts[1:]
  if mode not in NOISE_MODES or any(p != "smoke" for p in parts[1:]):
    raise common.ConfigError(
      f"configs/noise_factorial.py:{arg}: expected <noise>[,smoke] with <noise> one "
      f"of {', '.join(NOISE_MODES)}"
    )
  c = lm_corpus.get_config("smoke,kdn_diag" if smoke else "default,kdn_diag")
  c.model.info_scale = "k"
  c.model.noise = mode
  c.train.seeds = SEEDS
  return c
