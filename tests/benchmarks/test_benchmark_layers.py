"""experiments/benchmarks/layers.py at a tiny shape on CPU: kdn_jax layer rows are timed (and what
is timed is the layer and its full backward), the fla row is skipped with a reason, the time budget
stops new cells, and the verdicts follow the ratios."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import layers as bl
from kdn_jax.layers.registry import MIXERS
from kdn_jax.models.config import model_config

TINY = dict(
  seq_lens=(32,), batch=1, width=32, num_heads=2, head_dim=16, chunk_size=16, reps=1, warmup=0
)


def test_tiny_run_on_cpu(tmp_path, monkeypatch):
  out = str(tmp_path / "layers")
  timed = []  # per cell: (mixer, impl), then (function timed, its arguments) per timing
  real_times, real_median = bl._jax_times, bl.median_time

  def spy_times(mixer, impl, *rest):
    timed.append((mixer, impl))
    return real_times(mixer, impl, *rest)

  monkeypatch.setattr(bl, "_jax_times", spy_times)
  monkeypatch.setattr(
    bl, "median_time", lambda fn, *a, **kw: timed.append((fn, a)) or real_median(fn, *a, **kw)
  )
  rows_run = (
    "kdn_diag",
    "kda",
  )  # one KDN and one fla-style layer: the others take the same registry path
  bl.run(out, rows=rows_run + (bl.FLA_ROW,), **TINY)
  with open(out + ".json") as fh:
    res = json.load(fh)
  rows = {r["row"]: r for r in res["rows"]}
  for mixer in rows_run:
    r = rows[f"{mixer}_chunked"]
    for key in ("fwd_ms", "fwd_bwd_ms"):
      assert math.isfinite(r[key]) and r[key] > 0, r
  assert rows[bl.FLA_ROW]["skipped"], rows[bl.FLA_ROW]  # no CUDA (or no torch) on CPU
  assert "fwd_ms" not in rows[bl.FLA_ROW]
  assert len(res["verdicts"]) == len(bl.TARGETS)
  assert all("not measured" in v for v in res["verdicts"])
  md = (tmp_path / "layers.md").read_text()
  assert "kdn_diag_chunked" in md and (tmp_path / "layers.png").stat().st_size > 0
  _check_timed_kdn_diag(timed[:3])


def test_time_budget_stops_new_cells(tmp_path):
  res = bl.run(str(tmp_path / "b"), rows=("kdn_diag", bl.FLA_ROW), time_budget_s=-1.0, **TINY)
  assert [r["row"] for r in res["not_started"]] == ["kdn_diag_chunked"]
  assert [r["row"] for r in res["rows"]] == [bl.FLA_ROW]


def test_verdicts_from_ratios():
  """The layer bars: fwd+bwd <= 0.9x and forward <= 1.1x fla's layer, for both KDN layers."""
  rows = [
    dict(row=bl.FLA_ROW, T=4096, fwd_ms=1.0, fwd_bwd_ms=10.0),
    dict(row="kdn_diag_chunked", T=4096, fwd_ms=1.05, fwd_bwd_ms=9.5),
    dict(row="kdn_iso_chunked", T=4096, fwd_ms=1.2, fwd_bwd_ms=8.5),
  ]
  assert bl.verdicts({"rows": rows}) == [
    f"target kdn_diag_chunked fwd+bwd <= 0.9x {bl.FLA_ROW}: T=4096 0.95x -> MISSED",
    f"target kdn_diag_chunked fwd <= 1.1x {bl.FLA_ROW}: T=4096 1.05x -> MET",
    f"target kdn_iso_chunked fwd+bwd <= 0.9x {bl.FLA_ROW}: T=4096 0.85x -> MET",
    f"target kdn_iso_chunked fwd <= 1.1x {bl.FLA_ROW}: T=4096 1.20x -> MISSED",
  ]


def _check_timed_kdn_diag(timed):
  """What the run timed for kdn_diag is the registry's layer (the output of the layer built and
  called directly) and the gradient of sum(y * ct) w.r.t. the input and every parameter (equal to
  a vjp of that forward): a benchmark timing something else, or a backward that skips the
  parameters, fails here."""
  assert timed[0] == ("kdn_diag", "chunked"), timed[0]
  (fwd, (params, x)), (grad, (params_g, x_g, ct)) = timed[1:]
  assert x.shape == x_g.shape == ct.shape == (1, 32, 32)
  cfg = model_config(
    "tiny",
    d_model=32,
    num_heads=2,
    head_dim=16,
    mixer="kdn_diag",
    impl="chunked",
    chunk_size=16,
    dtype="bfloat16",
    param_dtype="float32",
    mlp_hidden=1,
  )
  graphdef, state = nnx.split(MIXERS["kdn_diag"](cfg, rngs=nnx.Rngs(0)))
  direct = jax.jit(lambda x: nnx.merge(graphdef, state)(x)[0])
  np.testing.assert_array_equal(fwd(params, x), direct(x))
  f32 = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float32), t)
  g_params, g_x = grad(params_g, x_g, ct)
  vjp = jax.jit(
    lambda p, x, ct: jax.vjp(lambda p, x: fwd(p, x).astype(jnp.float32), p, x)[1](
      ct.astype(jnp.float32)
    )
  )
  w_params, w_x = vjp(params, x, ct)
  np.testing.assert_allclose(f32(g_x), f32(w_x), rtol=2e-2, atol=1e-3)
  g_leaves, w_leaves = jax.tree.leaves(f32(g_params)), jax.tree.leaves(f32(w_params))
  assert len(g_leaves) == len(w_leaves) == len(jax.tree.leaves(params))
  # (some parameters start with a zero gradient: zero-initialised second layers)
  assert sum(np.any(g != 0) for g in g_leaves) > len(g_leaves) // 2
  for g, w in zip(g_leaves, w_leaves):
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=1e-3)
