"""experiments/benchmark_layers.py at a tiny shape on CPU: every kdn_jax layer row is timed, the fla row
is skipped with a reason, the time budget stops new cells, and the verdicts follow the ratios."""
from __future__ import annotations

import json
import math

from experiments import benchmark_layers as bl

TINY = dict(seq_lens=(32,), batch=1, width=32, num_heads=2, head_dim=16, chunk_size=16, reps=1,
            warmup=0)


def test_tiny_run_on_cpu(tmp_path):
  out = str(tmp_path / 'layers')
  bl.run(out, **TINY)
  with open(out + '.json') as fh:
    res = json.load(fh)
  rows = {r['row']: r for r in res['rows']}
  for mixer in bl.JAX_MIXERS:
    r = rows[f'{mixer}_chunked']
    for key in ('fwd_ms', 'fwd_bwd_ms'):
      assert math.isfinite(r[key]) and r[key] > 0, r
  assert rows[bl.FLA_ROW]['skipped'], rows[bl.FLA_ROW]  # no CUDA (or no torch) on CPU
  assert 'fwd_ms' not in rows[bl.FLA_ROW]
  assert len(res['verdicts']) == len(bl.TARGETS)
  assert all('not measured' in v for v in res['verdicts'])
  md = (tmp_path / 'layers.md').read_text()
  assert 'kdn_diag_chunked' in md and (tmp_path / 'layers.png').stat().st_size > 0


def test_time_budget_stops_new_cells(tmp_path):
  res = bl.run(str(tmp_path / 'b'), rows=('kdn_diag', bl.FLA_ROW), time_budget_s=-1.0, **TINY)
  assert [r['row'] for r in res['not_started']] == ['kdn_diag_chunked']
  assert [r['row'] for r in res['rows']] == [bl.FLA_ROW]


def test_verdicts_from_ratios():
  rows = [dict(row=bl.FLA_ROW, T=4096, fwd_ms=1.0, fwd_bwd_ms=10.0),
          dict(row='kdn_diag_chunked', T=4096, fwd_ms=1.0, fwd_bwd_ms=9.5),
          dict(row='kdn_iso_chunked', T=4096, fwd_ms=1.0, fwd_bwd_ms=9.5)]
  diag, iso = bl.verdicts({'rows': rows})
  assert diag.startswith('target kdn_diag_chunked') and diag.endswith('T=4096 0.95x -> MET'), diag
  assert iso.startswith('target kdn_iso_chunked') and iso.endswith('T=4096 0.95x -> MISSED'), iso
