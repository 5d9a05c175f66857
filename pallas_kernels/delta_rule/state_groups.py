"""Several chunks per serial step of the forward-only fused state pass (state_pass.py with
DeltaRuleConfig.state_step_chunks = n > 1; segment-free calls that store no states).

The chunk-16 stages give per chunk b of a group of n (state S at the group's start, S_b at
chunk b's, E_b = exp(g_last_b) the chunk's decay, D(i, b) = E_i ... E_{b-1}, D(b, b) = 1):

    Delta_b = U_b - W_b S_b,   S_{b+1} = E_b S_b + Wt_b^T Delta_b,   O_b = Qbar_b S_b + P_b Delta_b.

Unrolled over the group, with M_bj = (W_b D(j+1, b)) Wt_j^T ([C, C], j < b):

    Delta_b = Ut_b - Wt~_b S,   Ut_b = U_b - sum_j M_bj Ut_j,
                                Wt~_b = W_b D(0, b) - sum_j M_bj Wt~_j   (block forward substitution)
    S_next = D(0, n) S + sum_b (Wt_b D(b+1, n))^T Delta_b
    O_b = (Qbar_b D(0, b)) S + sum_{j<b} ((Qbar_b D(j+1, b)) Wt_j^T) Delta_j + P_b Delta_b

Everything but the two dots of the chain (W~ S, then the S update) depends only on the loaded
rows, so it is formed when the group is loaded (one group ahead, like the single-chunk step's
prefetch): the serial chain takes one step per n chunks, its dots n independent [C, K] x [K, BV]
ones at each of its two levels. Decays enter only as products of exp(g_last) <= 1 factors (no
exp of a positive number, no division)."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import dot, dot_nt, dot_tn


def _decay(e, i, j):
  """D(i, j) = e[i] ... e[j-1] as a [1, K] row, or None (the identity) when i == j."""
  out = None
  for m in range(i, j):
    out = e[m] if out is None else out * e[m]
  return out


def _scaled(x, d):
  return x if d is None else x * d


def group_inputs(r, b, h, vs, c0, n, C, scale, prec, dt, exp):
  """Chunks c0 .. c0 + n - 1 loaded and merged (the module docstring): per chunk Ut (f32) and,
  in the dots' operand dtype dt, Wt~, Wt D(b+1, n), Qbar D(0, b) and the row of P blocks; and
  the group's decay D(0, n) as a [K] vector. `exp`: kernel_math.exp_for_mode's."""
  f32 = jnp.float32
  e, u, wk, wt, qbar, p = [], [], [], [], [], []
  for i in range(n):
    t0 = (c0 + i) * C
    rows = pl.ds(t0, C)
    e.append(exp(r["g"][b, pl.ds(t0 + C - 1, 1), h, :].astype(f32)))   # [1, K]
    u.append(r["u"][b, rows, h, vs].astype(f32))
    wk.append(r["wk"][b, rows, h, :].astype(f32))
    wt.append(r["wt"][b, rows, h, :].astype(f32))
    qbar.append((scale * r["q"][b, rows, h, :].astype(f32))
                * exp(r["g"][b, rows, h, :].astype(f32)))
    p.append(r["p"][b, h, rows, :])
  ut, wtil, p_rows = [], [], []
  for i in range(n):
    ui, wi, p_row = u[i], _scaled(wk[i], _decay(e, 0, i)), []
    for j in range(i):
      m = dot_nt(_scaled(wk[i], _decay(e, j + 1, i)), wt[j], prec)
      ui = ui - dot(m, ut[j], prec)
      wi = wi - dot(m, wtil[j], prec)
      p_row.append(dot_nt(_scaled(qbar[i], _decay(e, j + 1, i)), wt[j], prec).astype(dt))
    ut.append(ui)
    wtil.append(wi)
    p_rows.append(p_row + [p[i].astype(dt)])
  last = _decay(e, 0, n)
  return dict(u=ut, w=[x.astype(dt) for x in wtil],
              wt=[_scaled(wt[i], _decay(e, i + 1, n)).astype(dt) for i in range(n)],
              q=[_scaled(qbar[i], _decay(e, 0, i)).astype(dt) for i in range(n)],
              p=p_rows, e=last.reshape(-1))


def group_step(x, s, o_ref, b, h, vs, c0, n, C, prec):
  """One serial step over the group loaded in x (group_inputs) from its start state s: stores
  the group's outputs and returns the state after it."""
  deltas = [x["u"][i] - dot(x["w"][i], s, prec) for i in range(n)]
  for i in range(n):
    o = dot(x["q"][i], s, prec)
    for j in range(i + 1):
      o = o + dot(x["p"][i][j], deltas[j], prec)
    o_ref[b, pl.ds((c0 + i) * C, C), h, vs] = o.astype(o_ref.dtype)
  s_next = x["e"][:, None] * s
  for i in range(n):
    s_next = s_next + dot_tn(x["wt"][i], deltas[i], prec)
  return s_next
