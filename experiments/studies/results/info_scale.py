"""RESULTS.md: KDN's information scale mu and the effective write strength beta_eff, from docs/results/mu/."""
from __future__ import annotations

import os

import numpy as np

from experiments.studies.results.common import exists, load, plt, save, table

SETTINGS = (('1', '1'), ('sqrt_k', 'sqrt(K)'), ('k', 'K'), ('4k', '4K'), ('learned', 'learned (init K)'))
PAPER = {'1': 0.943, 'sqrt_k': 0.891, 'k': 0.826, '4k': 0.805}  # the KDN paper's mean beta_eff, at scale


def _runs(results_dir):
  """{setting: (run dir)}; mu = K is the kdn_diag pretrain run of the length-generalisation study."""
  out = {}
  for key, _ in SETTINGS:
    d = (os.path.join(results_dir, 'lengen', 'kdn_diag', 'pretrain') if key == 'k' else
         os.path.join(results_dir, 'mu', key))
    if exists(d, 'eval', 'beta_eff.json'):
      out[key] = d
  return out


def render(results_dir: str, fig_dir: str) -> str:
  if not exists(results_dir, 'mu'):
    return ''
  runs = _runs(results_dir)
  cmds = load(os.path.join(results_dir, 'mu', 'commands.json'))
  rows, hist = [], {}
  for key, label in SETTINGS:
    if key not in runs:
      continue
    b = load(os.path.join(runs[key], 'eval', 'beta_eff.json'))
    ppl = load(os.path.join(runs[key], 'eval', 'ppl.json'))
    layers = [b['layers'][str(i)]['mean'] for i in range(len(b['layers']))]
    rows.append([label, b['meta']['step'], b['all']['mean'], PAPER.get(key, '-'), ppl['perplexity'],
                 ' / '.join(f'{v:.2f}' for v in layers)])
    hist[label] = (np.asarray(b['bins']), np.asarray(b['all']['hist'], float))
  p = plt()
  fig, ax = p.subplots(figsize=(6.5, 4))
  for label, (bins, h) in hist.items():
    ax.plot(0.5 * (bins[1:] + bins[:-1]), h / h.sum(), label=label)
  ax.set(xlabel=r'$\beta_{eff}$ = z / (r + z)', ylabel='fraction of tokens x heads x layers',
         title=r'kdn_diag $\beta_{eff}$ by information scale $\mu$')
  ax.grid(alpha=0.3)
  ax.legend(title=r'$\mu$')
  fig_path = save(fig, fig_dir, 'info_scale_beta.png')
  fixed = [r for r in rows if r[3] != '-']
  means = [r[2] for r in fixed]
  paper = [r[3] for r in fixed]
  monotone = all(a > b for a, b in zip(means, means[1:]))
  return '\n'.join([
      '## 2. Information scale mu and the effective write strength', '',
      f'Machine: {cmds["machine"]}.', '', '```', cmds['train'], cmds['evaluate'], cmds['mu_k'], '```', '',
      'beta_eff = z / (r + z), z = k^T P_hat k, per token, head and layer (MATH.md section 2), on 2 validation '
      'batches of 32 x 512 tokens, from the normal initial state.', '',
      table(['mu', 'step', 'mean beta_eff', 'paper (at scale)', 'val PPL', 'per-layer mean (layers 0..5)'], rows),
      '', f'![beta_eff histograms]({fig_path})', '',
      ('**Reproduced (direction):** ' if monotone else '**Not reproduced:** ')
      + 'the paper reports that write strength falls as mu grows (0.943, 0.891, 0.826, 0.805 for 1, sqrt(K), K, '
      f'4K); ours, in the same order: {", ".join(f"{m:.3f}" for m in means)}'
      + (' — the same monotone fall' if monotone else ' — not monotone')
      + '; the steps between neighbours are ' + ', '.join(f'{b - a:+.3f}' for a, b in zip(means, means[1:]))
      + ' (paper: ' + ', '.join(f'{b - a:+.3f}' for a, b in zip(paper, paper[1:]))
      + '). '
      + caveats(rows, cmds), ''])


def caveats(rows, cmds) -> str:
  """What limits the comparison, from the runs' own records."""
  steps = sorted({r[1] for r in rows})
  ppl = [r[4] for r in rows]
  out = ['Caveats: ']
  if len(steps) > 1:
    out.append(f'the runs were evaluated at different steps ({", ".join(map(str, steps))}), so the perplexity '
               'column mixes training lengths; ')
  else:
    out.append(f'every run is evaluated at step {steps[0]}; ')
  spread = 100 * (max(ppl) - min(ppl)) / min(ppl)
  out.append(f'validation perplexities span {min(ppl):.1f}-{max(ppl):.1f} ({spread:.1f}% apart) with one seed per '
             'setting and no measured run-to-run spread, so their order is not a finding; learning rates were not '
             'tuned per setting.')
  if cmds.get('corpus_note'):
    out.append(' ' + cmds['corpus_note'])
  return ''.join(out)
