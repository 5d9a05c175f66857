"""Evaluates a trained run's checkpoint; writes JSON numbers and PNG plots into ``<workdir>/eval/``.

    python -m experiments.evaluate --workdir=/tmp/kdn_mqar_smoke
    python -m experiments.evaluate --workdir=/ckpt/lm --suite=position_ppl,effrem --max_len=32768
    python -m experiments.evaluate --workdir=/ckpt/lm --step=2000 --suite=retrieval
    python -m experiments.evaluate --workdir=/ckpt/lm --all_steps --suite=position_ppl  # every checkpoint
    python -m experiments.evaluate --workdir=/tmp/ls/gla --suite=topic_floor --chunk=512
    python -m experiments.evaluate --workdir=/ckpt/lm --suite=beta_eff --override_info_scale=4k  # mu probe

Suites (``--suite``, comma-separated; default by the run's data: language-model runs
``ppl,position_ppl,effrem,beta_eff,retrieval`` (position_ppl also writes state_stats), synthetic-task runs
``retrieval,state_stats,beta_eff``, topic-source runs ``ppl,topic_floor,beta_eff``), each left-out default
named with its reason; in the default LM suites an S-NIAH task that scores 0 at its shortest length is not
scored at longer ones (``--suite=retrieval`` scores the whole grid): see experiments/evaluation/suites.py.
Evaluation always starts from the
model's normal initial state (never the training intervention), carries state chunk by chunk over long
inputs, and never touches the run's own records (metrics.jsonl, summary.json, checkpoints). Every input
problem (no checkpoint, unknown suite, a length the data cannot serve) is reported before any long work.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by experiments.train.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_ALL_STEPS = flags.DEFINE_bool(
  "all_steps",
  False,
  "Evaluate every saved checkpoint, each into <out>/step<k> (default <workdir>/eval/step<k>): "
  "the trend over training tokens.",
)
_SUITE = flags.DEFINE_string(
  "suite", "", "Comma-separated suites (default: by the run's data kind)."
)
_OUT = flags.DEFINE_string("out", "", "Output directory (default <workdir>/eval).")
_MAX_LEN = flags.DEFINE_integer(
  "max_len", 0, "position_ppl / state_stats length (0: max(32768, 8x train))."
)
_CHUNK = flags.DEFINE_integer("chunk", 0, "Tokens per carried chunk (0: the training length).")
_NUM_SEQ = flags.DEFINE_integer(
  "num_sequences", 16, "Long sequences for position_ppl / state_stats."
)
_EFFREM_LEN = flags.DEFINE_integer("effrem_len", 0, "EffRem T (0: 4x the training length).")
_EFFREM_POINTS = flags.DEFINE_integer("effrem_points", 33, "EffRem prefix cut points.")
_EFFREM_SEQ = flags.DEFINE_integer("effrem_sequences", 8, "Sequences averaged for EffRem.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per forward pass.")
_RLENGTHS = flags.DEFINE_list(
  "retrieval_lengths", [], "Retrieval lengths (default: train x 1, 2, 4, 8)."
)
_REXAMPLES = flags.DEFINE_integer("retrieval_examples", 32, "Examples per retrieval grid cell.")
_LONG_EVAL = flags.DEFINE_string(
  "long_eval_path", "", "Long documents (default: the run's long_eval_path)."
)
_TOKENIZER = flags.DEFINE_string(
  "tokenizer", "", "tokenizer.json for S-NIAH (default: the run's corpus)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated evaluation tasks.")
_DOCUMENTS = flags.DEFINE_integer(
  "documents", 64, "topic_floor: evaluation documents (the bootstrap units)."
)
_RESAMPLES = flags.DEFINE_integer("resamples", 2000, "topic_floor: bootstrap resamples.")
_CONTEXT = flags.DEFINE_integer(
  "context",
  1,
  "Devices one sequence is split over: the recurrent ops split T "
  "over them (context parallelism; lengths they do not divide run unsplit).",
)
_OVERRIDE_MU = flags.DEFINE_string(
  "override_info_scale",
  "",
  "Evaluate the trained parameters with KDN's "
  "information scale mu replaced (1, sqrt_k, k, 4k or a number; the run must "
  "have trained a fixed mu): the fixed-weight beta_eff probe. Output defaults "
  "to <workdir>/eval/info_scale_<mu>.",
)
flags.mark_flags_as_required(["workdir"])


def settings_from_flags():
  from experiments.evaluation.suites import Settings  # pylint: disable=g-import-not-at-top

  for name, flag in (("--max_len", _MAX_LEN), ("--chunk", _CHUNK), ("--effrem_len", _EFFREM_LEN)):
    if flag.value < 0:
      raise ValueError(f"{name}: must be >= 0, got {flag.value}")
  for name, flag in (
    ("--num_sequences", _NUM_SEQ),
    ("--effrem_points", _EFFREM_POINTS),
    ("--effrem_sequences", _EFFREM_SEQ),
    ("--batch", _BATCH),
    ("--retrieval_examples", _REXAMPLES),
    ("--documents", _DOCUMENTS),
    ("--resamples", _RESAMPLES),
  ):
    if flag.value <= 0:
      raise ValueError(f"{name}: must be positive, got {flag.value}")
  try:
    lengths = tuple(int(x) for x in _RLENGTHS.value)
  except ValueError as e:
    raise ValueError(f"--retrieval_lengths: expected integers, got {_RLENGTHS.value}") from e
  return Settings(
    max_len=_MAX_LEN.value,
    chunk=_CHUNK.value,
    num_sequences=_NUM_SEQ.value,
    effrem_len=_EFFREM_LEN.value,
    effrem_points=_EFFREM_POINTS.value,
    effrem_sequences=_EFFREM_SEQ.value,
    batch=_BATCH.value,
    retrieval_lengths=lengths,
    retrieval_examples=_REXAMPLES.value,
    long_eval_path=_LONG_EVAL.value,
    tokenizer=_TOKENIZER.value,
    seed=_SEED.value,
    documents=_DOCUMENTS.value,
    resamples=_RESAMPLES.value,
  )


def context_parallel(num_devices: int):
  """The context the suites run in: T split over the first ``num_devices`` devices (a no-op for 1)."""
  import contextlib  # pylint: disable=g-import-not-at-top

  if num_devices == 1:
    return contextlib.nullcontext()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from experiments.runner import sharding  # pylint: disable=g-import-not-at-top

  if not 1 <= num_devices <= len(jax.devices()):
    raise ValueError(
      f"--context: must be in [1, {len(jax.devices())}] (the devices), got {num_devices}"
    )
  devices = np.array(jax.devices()[:num_devices]).reshape(1, 1, 1, num_devices)
  return sharding.context_parallel(jax.sharding.Mesh(devices, sharding.AXES))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  suites = [s.strip() for s in _SUITE.value.split(",") if s.strip()]
  from experiments.evaluation.suites import SUITES  # pylint: disable=g-import-not-at-top

  unknown = [s for s in suites if s not in SUITES]
  if unknown:  # before any checkpoint is read
    print(
      f"Evaluation error: --suite: unknown suite(s) {unknown}; expected names from {list(SUITES)}",
      file=sys.stderr,
    )
    return 2
  from experiments.evaluation import runner  # pylint: disable=g-import-not-at-top  (imports jax)
  from kdn_jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  dispatch.warm_kernel_imports()  # before anything is traced (see the function)
  try:
    if _ALL_STEPS.value and _STEP.value is not None:
      raise ValueError("--all_steps: evaluates every checkpoint; give it or --step, not both")
    from experiments import loading  # pylint: disable=g-import-not-at-top

    settings = settings_from_flags()
    check_out(_OUT.value)
    steps = loading.saved_steps(_WORKDIR.value) if _ALL_STEPS.value else [_STEP.value]
    with context_parallel(_CONTEXT.value):
      overrides = {"info_scale": _OVERRIDE_MU.value} if _OVERRIDE_MU.value else None
      for step in steps:
        out = _OUT.value
        if _ALL_STEPS.value:
          out = os.path.join(_OUT.value or os.path.join(_WORKDIR.value, "eval"), f"step{step}")
        runner.evaluate(_WORKDIR.value, suites, settings, step, out, overrides)
  except (ValueError, FileNotFoundError) as e:
    print(f"Evaluation error: {as_flag(str(e))}", file=sys.stderr)
    return 2
  return 0


def check_out(out: str):
  """--out must be a directory or a path where one can be made (checked before any checkpoint is read)."""
  if not out:
    return
  path = os.path.abspath(out)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    raise ValueError(
      f"--out={out}: {'is' if path == os.path.abspath(out) else f'{path} is'} a file; expected a "
      "directory (new or existing)"
    )


def as_flag(message: str) -> str:
  """experiments.load names its arguments (``workdir: ...``); on this command line they are flags."""
  for name in ("workdir", "step", "tokenizer"):
    if message.startswith(f"{name}: "):
      return f"--{message}"
  return message


if __name__ == "__main__":
  app.run(main)
