"""RESULTS.md: the MQAR grid (issue 17 item 1), from docs/results/mqar/grid.json (written by
``python -m experiments.studies.mqar_grid``) and commands.json."""
from __future__ import annotations

import os

import numpy as np

from experiments.studies.results.common import exists, load, plt, save, table

# A kdn_diag - kda difference in best accuracy below this is called a tie.
MARGIN = 0.02


def _best(grid) -> dict:
  return {tuple(k.split('/')): v for k, v in grid['best'].items()}


def _coverage(grid) -> tuple[dict, list[float]]:
  """{(cell, mixer): completed learning rates}, and the rates completed in every cell and mixer."""
  done = {}
  for r in grid['runs']:
    if r['status'] == 'completed':
      done.setdefault((r['cell'], r['mixer']), []).append(r['learning_rate'])
  full = [lr for lr in grid['learning_rates']
          if all(lr in done.get((c, m), []) for c in grid['cells'] for m in grid['mixers'])]
  return done, full


def _plot(grid, best, fig_dir) -> str:
  cells, mixers = grid['cells'], grid['mixers']
  p = plt()
  fig, ax = p.subplots(figsize=(9, 3.8))
  width = 0.8 / len(mixers)
  x = np.arange(len(cells))
  for i, m in enumerate(mixers):
    acc = [best[(c, m)]['accuracy'] if (c, m) in best else np.nan for c in cells]
    ax.bar(x + (i - (len(mixers) - 1) / 2) * width, acc, width, label=m)
  ax.set_xticks(x, [c.replace('_', '\n') for c in cells])
  ax.set(ylabel='validation accuracy', ylim=(0, 1.02), title='MQAR: best accuracy per cell (missing bar: not run)')
  ax.grid(axis='y', alpha=0.3)
  ax.legend(ncol=len(mixers), fontsize=8, loc='upper center', bbox_to_anchor=(0.5, -0.28))
  return save(fig, fig_dir, 'mqar_grid.png')


def _verdict(grid, best, spread=None) -> str:
  """``spread``: the largest run-to-run accuracy difference of identical runs (None: not measured)."""
  pairs = [(c, best[(c, 'kdn_diag')]['accuracy'], best[(c, 'kda')]['accuracy']) for c in grid['cells']
           if (c, 'kdn_diag') in best and (c, 'kda') in best]
  if not pairs:
    return '**Not tested:** no cell has both kdn_diag and kda.'
  # Cells where both stayed near chance rank neither.
  chance = [c for c, a, b in pairs if max(a, b) < 0.1]
  live = [(c, a, b) for c, a, b in pairs if max(a, b) >= 0.1]
  ahead = [c for c, a, b in live if a - b > MARGIN]
  behind = [c for c, a, b in live if b - a > MARGIN]
  tied = [c for c, a, b in live if abs(a - b) <= MARGIN]
  if ahead and not behind:
    head = '**Partly reproduced (direction):** kdn_diag is never behind kda and ahead in some cells'
  elif behind and not ahead:
    head = '**Not reproduced:** kdn_diag is behind kda'
  elif not ahead and not behind:
    head = '**Not reproduced:** kdn_diag and kda tie'
  else:
    head = '**Not reproduced as a consistent lead:** kdn_diag and kda trade places'
  diffs = ', '.join(f'{c}: {a - b:+.3f}' for c, a, b in live)
  return (f'{head} — kdn_diag - kda in best accuracy where either learned (>= 0.1): {diffs or "no such cell"}; '
          f'ahead in {len(ahead)}, behind in {len(behind)}, tied (within {MARGIN}) in {len(tied)}'
          + (f'; both near chance in {", ".join(chance)}' if chance else '') + '. The paper\'s claim is '
          'about S-NIAH at 750M-1.3B parameters (+8.2 and +12.2 points over KDA); a 2-layer MQAR model is a '
          'far weaker test of it.' + ('' if not behind else
          f' *Why we think so:* kdn_diag trails in {", ".join(behind)}, 64-pair cells where most mixers are at '
          'the edge of learning within 2000 steps (near chance at most rates'
          + ('' if spread is None else f'; two identical runs differ by up to {spread:.2f} in the run-to-run '
             'table below') + '), so they compare how soon training takes off more than '
          'recall capacity; the Kalman gain starts with weak writes (beta_eff < 1), which may slow that '
          'take-off at this size. Testing the claim needs training until the cells saturate, several seeds, '
          'or the paper\'s S-NIAH at scale.'))


def render(results_dir: str, fig_dir: str) -> str:
  path = os.path.join(results_dir, 'mqar', 'grid.json')
  if not exists(path):
    return ''
  grid, cmds = load(path), load(os.path.join(results_dir, 'mqar', 'commands.json'))
  best = _best(grid)
  done, full = _coverage(grid)
  pairs = _run_to_run(grid, results_dir)
  cells, mixers = grid['cells'], grid['mixers']
  rows = []
  single = {(r['cell'], r['mixer']) for r in grid['runs'] if r['status'] == 'completed' and not r.get('sweep')}
  for m in mixers:
    row = [m]
    for c in cells:
      b = best.get((c, m))
      row.append('not run' if b is None else
                 f'{b["accuracy"]:.3f} ({b["learning_rate"]:g})' + (' *' if (c, m) in single else ''))
    rows.append(row)
  params = {m: next((b['num_params'] for (c, mm), b in best.items() if mm == m and c.startswith('d64_')), None)
            for m in mixers}
  n_done = sum(r['status'] == 'completed' for r in grid['runs'])
  swept = [f'{c}/{m}' for (c, m), lrs in done.items() if len(lrs) == len(grid['learning_rates'])]
  stopped = sorted({f'{r["cell"]}/{r["mixer"]}' for r in grid['runs']
                    if r['status'] not in ('completed', 'missing') and (r['cell'], r['mixer']) not in best})
  partial = sorted(f'{c}/{m}' for (c, m), lrs in done.items() if len(lrs) < len(grid['learning_rates']))
  missing = sorted(f'{c}/{m}' for c in cells for m in mixers if (c, m) not in done and f'{c}/{m}' not in stopped)
  coverage = (f'{n_done} of {len(grid["runs"])} runs completed. Learning rates complete over the whole grid: '
              f'{", ".join(f"{lr:g}" for lr in full) or "none"}; cells x mixers with the full sweep '
              f'({", ".join(f"{lr:g}" for lr in grid["learning_rates"])}): {len(swept)} of '
              f'{len(cells) * len(mixers)}. Each entry is the best completed rate\'s accuracy (the rate in '
              'brackets).')
  if partial:
    coverage += (f' **Without the full sweep** (one rate only, marked *: a single run of an earlier session, same '
                 f'config and seed): {", ".join(partial)}.')
  if missing:
    coverage += f' **Not run**: {", ".join(missing)}.'
  if stopped:
    coverage += f' Stopped by the time limit before their final evaluation: {", ".join(stopped)}.'
  if cmds.get('note'):
    coverage += ' ' + cmds['note']
  return '\n'.join([
      '## 1. MQAR', '',
      f'Machine: {cmds["machine"]}.', '', '```', cmds['grid'], cmds['run'], '```', '',
      cmds['protocol'].replace('best learning rate per cell and mixer.', 'the best completed learning rate per cell and mixer.'), 'Parameters (d_model 64): ' + ', '.join(f'{m} {n / 1e6:.3f}M' for m, n in params.items()
                                                             if n) + ' (mixers matched to kdn_diag through '
      'the MLP width; most parameters are the 8192-token embedding).', '',
      coverage, '',
      table(['mixer'] + cells, rows), '',
      f'![MQAR grid]({_plot(grid, best, fig_dir)})', '',
      _verdict(grid, best, _spread(pairs)), _learned(grid, best), '',
      _by_rate(grid), '', _reproduced(pairs), ''])


def _by_rate(grid) -> str:
  """Every completed run's accuracy, one column per learning rate."""
  acc = {(r['cell'], r['mixer'], r['learning_rate']): r['accuracy'] for r in grid['runs']
         if r['status'] == 'completed'}
  lrs = grid['learning_rates']
  rows = [[c, m] + [f'{acc[(c, m, lr)]:.3f}' if (c, m, lr) in acc else '-' for lr in lrs]
          for c in grid['cells'] for m in grid['mixers']]
  return ('Accuracy at every learning rate (- : not run):\n\n'
          + table(['cell', 'mixer'] + [f'lr {lr:g}' for lr in lrs], rows))


def _run_to_run(grid, results_dir) -> list:
  """(cell, mixer, lr, single-run accuracy, sweep-member accuracy): a sweep member against the single run of
  the same config, seed and rate from an earlier session (on CPU the two agree to float rounding,
  tests/test_lr_sweep.py; on the GPU they also differ by non-deterministic reductions)."""
  root = os.path.join(results_dir, 'mqar', 'single_runs_session26')
  pairs = []
  for r in grid['runs']:
    path = os.path.join(root, r['cell'], r['mixer'], f'lr{r["learning_rate"]:g}', 'summary.json')
    if r['status'] == 'completed' and r.get('sweep') and exists(path):
      old = load(path)
      if old.get('status') == 'completed':
        pairs.append((r['cell'], r['mixer'], r['learning_rate'], old['eval']['accuracy'], r['accuracy']))
  return pairs


def _spread(pairs):
  return max((abs(b - a) for *_, a, b in pairs), default=None)


def _reproduced(pairs) -> str:
  if not pairs:
    return ''
  diffs = np.array([b - a for *_, a, b in pairs])
  rows = [[c, m, f'{lr:g}', f'{a:.3f}', f'{b:.3f}', f'{b - a:+.3f}'] for c, m, lr, a, b in pairs]
  return ('Run to run: the same config, seed and rate trained as a single run (an earlier session, '
          '`docs/results/mqar/single_runs_session26/`) and as a member of this sweep, on the same kind of GPU: '
          f'{len(pairs)} pairs, median |difference| {np.median(np.abs(diffs)):.3f}, largest '
          f'{np.abs(diffs).max():.3f}. Runs that learn slowly (accuracy well below 1 at the end) move most: '
          'a small difference early in training (GPU reductions are not bitwise deterministic) changes when '
          'the model starts to learn the task. Differences of this size between mixers are not findings.\n\n'
          + table(['cell', 'mixer', 'lr', 'single run', 'sweep member', 'difference'], rows))


def _learned(grid, best) -> str:
  """Which mixers solved each cell (accuracy >= 0.9) and which stayed near chance (< 0.1)."""
  parts = []
  for c in grid['cells']:
    got = {m: best[(c, m)]['accuracy'] for m in grid['mixers'] if (c, m) in best}
    if got:
      hi = [m for m, a in got.items() if a >= 0.9] or ['none']
      lo = [m for m, a in got.items() if a < 0.1] or ['none']
      parts.append(f'{c}: solved (>= 0.9) by {", ".join(hi)}; near chance (< 0.1): {", ".join(lo)}')
  return ('Per cell: ' + '; '.join(parts) + '. Where most mixers stay near chance the cell ranks how fast '
          'a model starts to learn within the step budget more than its recall capacity.')
