"""Evaluates a trained run's checkpoint; writes JSON numbers and PNG plots into ``<workdir>/eval/``.

    python -m experiments.evaluate --workdir=/tmp/kdn_mqar_smoke
    python -m experiments.evaluate --workdir=/ckpt/lm --suite=position_ppl,effrem --max_len=32768
    python -m experiments.evaluate --workdir=/ckpt/lm --step=2000 --suite=retrieval

Suites (``--suite``, comma-separated; default by the run's data: language-model runs
``ppl,position_ppl,effrem,beta_eff,retrieval`` (position_ppl also writes state_stats), synthetic-task runs
``retrieval,state_stats,beta_eff``): see experiments/evaluation/suites.py. Evaluation always starts from the
model's normal initial state (never the training intervention), carries state chunk by chunk over long
inputs, and never touches the run's own records (metrics.jsonl, summary.json, checkpoints). Every input
problem (no checkpoint, unknown suite, a length the data cannot serve) is reported before any long work.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory written by experiments.train.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_SUITE = flags.DEFINE_string('suite', '', 'Comma-separated suites (default: by the run\'s data kind).')
_OUT = flags.DEFINE_string('out', '', 'Output directory (default <workdir>/eval).')
_MAX_LEN = flags.DEFINE_integer('max_len', 0, 'position_ppl / state_stats length (0: max(32768, 8x train)).')
_CHUNK = flags.DEFINE_integer('chunk', 0, 'Tokens per carried chunk (0: the training length).')
_NUM_SEQ = flags.DEFINE_integer('num_sequences', 16, 'Long sequences for position_ppl / state_stats.')
_EFFREM_LEN = flags.DEFINE_integer('effrem_len', 0, 'EffRem T (0: 4x the training length).')
_EFFREM_POINTS = flags.DEFINE_integer('effrem_points', 33, 'EffRem prefix cut points.')
_EFFREM_SEQ = flags.DEFINE_integer('effrem_sequences', 8, 'Sequences averaged for EffRem.')
_BATCH = flags.DEFINE_integer('batch', 8, 'Rows per forward pass.')
_RLENGTHS = flags.DEFINE_list('retrieval_lengths', [], 'Retrieval lengths (default: train x 1, 2, 4, 8).')
_REXAMPLES = flags.DEFINE_integer('retrieval_examples', 32, 'Examples per retrieval grid cell.')
_LONG_EVAL = flags.DEFINE_string('long_eval_path', '', 'Long documents (default: the run\'s long_eval_path).')
_TOKENIZER = flags.DEFINE_string('tokenizer', '', 'tokenizer.json for S-NIAH (default: the run\'s corpus).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the generated evaluation tasks.')
flags.mark_flags_as_required(['workdir'])


def settings_from_flags():
  from experiments.evaluation.suites import Settings  # pylint: disable=g-import-not-at-top
  for name, flag in (('--max_len', _MAX_LEN), ('--chunk', _CHUNK), ('--effrem_len', _EFFREM_LEN)):
    if flag.value < 0:
      raise ValueError(f'{name}: must be >= 0, got {flag.value}')
  for name, flag in (('--num_sequences', _NUM_SEQ), ('--effrem_points', _EFFREM_POINTS),
                     ('--effrem_sequences', _EFFREM_SEQ), ('--batch', _BATCH),
                     ('--retrieval_examples', _REXAMPLES)):
    if flag.value <= 0:
      raise ValueError(f'{name}: must be positive, got {flag.value}')
  try:
    lengths = tuple(int(x) for x in _RLENGTHS.value)
  except ValueError as e:
    raise ValueError(f'--retrieval_lengths: expected integers, got {_RLENGTHS.value}') from e
  return Settings(max_len=_MAX_LEN.value, chunk=_CHUNK.value, num_sequences=_NUM_SEQ.value,
                  effrem_len=_EFFREM_LEN.value, effrem_points=_EFFREM_POINTS.value,
                  effrem_sequences=_EFFREM_SEQ.value, batch=_BATCH.value, retrieval_lengths=lengths,
                  retrieval_examples=_REXAMPLES.value, long_eval_path=_LONG_EVAL.value,
                  tokenizer=_TOKENIZER.value, seed=_SEED.value)


def evaluate(workdir: str, suites=None, settings=None, step=None, out_dir: str = '') -> dict:
  """Runs ``suites`` on ``workdir``'s checkpoint; writes <out_dir>/<suite>.json, PNGs and summary.json."""
  from experiments import logging_utils  # pylint: disable=g-import-not-at-top
  from experiments.evaluation import long_context, plots, run_loader  # pylint: disable=g-import-not-at-top
  from experiments.evaluation import suites as S  # pylint: disable=g-import-not-at-top

  settings = settings or S.Settings()
  run = run_loader.load(workdir, step)
  ctx = S.Context(run, long_context.ChunkedScorer(run.model), settings)
  suites = list(suites or S.default_suites(ctx))
  S.check(ctx, suites)
  out_dir = out_dir or os.path.join(workdir, 'eval')
  os.makedirs(out_dir, exist_ok=True)
  print(f'Evaluating {run.checkpoint} ({run.config.model.get("mixer")}, trained on {run.config.data.kind}, '
        f'length {ctx.train_len}): {", ".join(suites)} -> {out_dir}', flush=True)
  meta = {'workdir': os.path.abspath(workdir), 'checkpoint': run.checkpoint, 'step': run.step,
          'mixer': run.config.model.get('mixer'), 'layer_pattern': run.config.model.get('layer_pattern'),
          'initial_state': run.config.train.initial_state, 'train_len': ctx.train_len,
          'settings': {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()}}
  results, times = {}, {}

  def done(name, res, t0):
    times[name] = time.time() - t0
    res = {**res, 'meta': meta, 'wall_time_s': times[name]}
    results[name] = res
    logging_utils.write_json(os.path.join(out_dir, f'{name}.json'), res)
    print(f'{name}: done in {logging_utils.fmt_time(times[name])}', flush=True)

  for name in suites:
    t0 = time.time()
    if name == 'position_ppl':
      res, stats, per_pos = S.position_ppl(ctx)
      S.write_npy(os.path.join(out_dir, 'position_nll.npy'), per_pos.astype(np.float32))
      done(name, res, t0)
      if 'state_stats' not in results:
        done('state_stats', stats, t0)
    elif name == 'state_stats':
      if 'state_stats' not in results:
        done(name, S.state_stats(ctx), t0)
    elif name == 'retrieval':
      done(name, S.run_retrieval(ctx), t0)
    else:
      done(name, getattr(S, name)(ctx), t0)
  pngs = plots.save_all(out_dir, results)
  summary = {**meta, 'suites': list(results), 'wall_time_s': times, 'plots': [os.path.basename(p) for p in pngs],
             'headline': _headline(results)}
  logging_utils.write_json(os.path.join(out_dir, 'summary.json'), summary)
  for line in _headline(results):
    print(line, flush=True)
  print(f'Wrote {len(results)} JSON files and {len(pngs)} plots to {out_dir}', flush=True)
  return results


def _headline(results) -> list[str]:
  from experiments.evaluation import plots  # pylint: disable=g-import-not-at-top
  lines = []
  if 'ppl' in results:
    lines.append(f'validation perplexity {results["ppl"]["perplexity"]:.3f}')
  if 'position_ppl' in results:
    r = results['position_ppl']
    lines.append(f'position-wise: PPL {r["perplexity"]:.3f} over {r["max_len"]} tokens; p* {r["p_star"]} at '
                 f't* {r["t_star"]}; within p* up to t = {r["generalises_to"]}')
  if 'effrem' in results:
    r = results['effrem']
    lines.append(f'EffRem_T (T={r["T"]}): t=0 {r["mean"][0]:.3f}, middle {r["mean"][len(r["mean"]) // 2]:.3f}, '
                 f'last {r["mean"][-1]:.3f}')
  if 'beta_eff' in results and 'all' in results['beta_eff']:
    lines.append(f'beta_eff mean {results["beta_eff"]["all"]["mean"]:.3f}')
  for task, rows in results.get('retrieval', {}).get('tasks', {}).items():
    metric = plots.METRIC[task]
    by_len = {}
    for r in rows:
      by_len.setdefault(r['length'], []).append(r[metric])
    lines.append(f'{task} {metric.replace("_", " ")} by length: ' + ', '.join(f'{n}: {np.mean(v):.2f}' for n, v in
                                                                 sorted(by_len.items())))
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  suites = [s.strip() for s in _SUITE.value.split(',') if s.strip()]
  try:
    evaluate(_WORKDIR.value, suites, settings_from_flags(), _STEP.value, _OUT.value)
  except (ValueError, FileNotFoundError) as e:
    print(f'Evaluation error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  app.run(main)
