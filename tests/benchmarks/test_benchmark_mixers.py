"""experiments/benchmarks/mixers/ on CPU: the kernel check at a tiny shape (interpret mode) meets
the accuracy bounds, sweep specs parse into configs and bad ones are refused, and the winners of a
sweep combine into one spec."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks.mixers import arg_specs, check, cli, sweeps, timing
from experiments.kernel_config import config_from_spec
from pallas_kernels import KernelConfigs
from pallas_kernels.delta_rule import config as dr_config
from pallas_kernels.kdn_gain import config as gain_config


def test_check_meets_bounds_in_interpret_mode():
  res = check.run_check(b=1, t=40, h=1, d=16, cut=13)
  assert any("seg_" in k for k in res)
  assert "delta_rule_float32_seg_dh0" in res
  assert {"delta_rule_bfloat16_seg_beta_dbeta", "delta_rule_float32_seg_beta_o"} <= set(res)
  assert {"diag_kdn_bfloat16_seg_dla", "iso_kdn_float32_seg_o"} <= set(res)
  assert {"diag_gain_float32_dp0", "iso_gain_bfloat16_dmu", "iso_gain_float32_kappa"} <= set(res)
  assert check.check_violations(res) == {}, res


def test_check_violations_use_the_issue_bounds():
  res = {
    "delta_rule_float32_o": 2e-5,
    "delta_rule_float32_seg_dk": 5e-5,
    "delta_rule_bfloat16_dv": 2e-2,
    "delta_rule_bfloat16_S": 4e-3,
    "diag_gain_float32_kappa": float("nan"),
    "iso_gain_bfloat16_dmu": 9e-3,
  }
  assert check.check_violations(res) == {
    "delta_rule_float32_o": 2e-5,
    "delta_rule_bfloat16_dv": 2e-2,
    "diag_gain_float32_kappa": res["diag_gain_float32_kappa"],
  }


def test_config_from_spec():
  base = dr_config.DeltaRuleConfig()
  assert config_from_spec(base, "default") is base
  cfg = config_from_spec(base, "max_chunk=64/bf16_states=0/num_warps_intra=2/block_v=64")
  assert (cfg.max_chunk, cfg.bf16_states, cfg.num_warps_intra, cfg.block_v) == (64, False, 2, 64)
  assert config_from_spec(gain_config.GainConfig(), "max_chunk=128").max_chunk == 128
  with pytest.raises(ValueError, match="expected one of"):
    config_from_spec(base, "bf16_states=yes")
  with pytest.raises(ValueError, match="field=value"):
    config_from_spec(base, "chunk=64")
  with pytest.raises(ValueError, match="DeltaRuleConfig.block_v"):
    config_from_spec(base, "block_v=48")


def test_combine_winners():
  timed = [
    ("num_warps_output=4", 10.0),
    ("bf16_states=0", 9.0),
    ("block_v=64", 11.0),
    ("num_stages=2", 8.0),
    ("pair_heads=8", None),
  ]
  assert sweeps.combine_winners(timed) == "num_warps_output=4/bf16_states=0/num_stages=2"
  assert sweeps.combine_winners(timed[:3]) is None  # one winner: nothing new to try
  assert sweeps.combine_winners([("default", None), ("bf16_states=0", 1.0), ("x=1", 1.0)]) is None
  # Two winners setting one field: the faster one's value is kept.
  assert (
    sweeps.combine_winners(
      [("default", 10.0), ("max_chunk=16", 8.0), ("max_chunk=64/bf16_states=0", 9.0)]
    )
    == "max_chunk=16/bf16_states=0"
  )


def _stage_names(docs):
  """The stage split's keys: the gain, then the delta rule's stages as the op runs them (a call
  not differentiated fuses the output into the state pass only without documents; with them
  the backward adds S_init's share of the restarting segments)."""
  fwd = ["pairs", "wy", "state", "output", "sum"]
  fwd_only = ["pairs", "wy", "state", "output"] if docs else ["pairs", "wy", "state_output"]
  bwd = ["state_grads", "partials"] + (["seg_init"] if docs else [])
  bwd += ["intra_tokens", "reverse_cumsum", "sum"]
  return (
    {"gain_fwd", "first_call_s"}
    | {"fwd/" + n for n in fwd}
    | {"fwd_only/" + n for n in fwd_only + ["sum"]}
    | {"bwd/" + n for n in bwd}
  )


# a sweep at a tiny shape: batch 1, one head of width 16, T = 40, one timed run
_TINY = sweeps.Sweep(timing.Timing(arg_specs.Shape(1, 1, 16), reps=1, warmup=0), length=40)


def test_sweep_with_stages_at_tiny_shape():
  """The sweep times every spec (and its stage split), keeps the fastest as the default, records
  what it tried, and times nothing past its deadline."""
  old = dr_config.DeltaRuleConfig()
  base = KernelConfigs(delta_rule=old)
  results = {}
  make = lambda spec: config_from_spec(old, spec)
  spec = "block_v=32/bf16_states=0/num_warps_parallel=8"
  got = sweeps.sweep(
    results,
    ["default", spec],
    base,
    "delta_rule",
    make,
    "diag_kdn_pallas",
    True,
    "cfg",
    float("inf"),
    _TINY,
    stages=True,
  )
  recs = results["sweeps"]
  # (the baseline timed again after the others, without its stage split: --sweep_repeat_first)
  assert [r["sweep"] for r in recs] == ["default", spec, "default"]
  assert recs[2]["repeat"] and "stages" not in recs[2] and recs[2]["ms"] > 0
  for r in recs[:2]:
    assert r["ms"] > 0 and r["first_call_s"] > 0, r
    # the op's own stage list (pallas_kernels.delta_rule.forward_stages / backward_stages)
    assert set(r["stages"]) == _stage_names(docs=False), r
  assert results["cfg"] == repr(got.delta_rule)
  assert got.delta_rule in (old, make(spec)) and base.delta_rule is old
  # Past the deadline nothing runs.
  late = {}
  got = sweeps.sweep(
    late, ["max_chunk=32"], base, "delta_rule", make, "diag_kdn_pallas", True, "cfg", 0.0, _TINY
  )
  assert (
    late["sweeps"] == [{"sweep": "max_chunk=32", "skipped": "time budget"}] and "cfg" not in late
  )
  assert got is base


def test_sweep_restores_the_default_when_every_spec_fails(monkeypatch):
  def fail(*a, **k):
    raise RuntimeError("compile error")

  monkeypatch.setattr(timing, "time_jax_row", fail)
  old = dr_config.DeltaRuleConfig()
  base = KernelConfigs(delta_rule=old)
  results = {}
  got = sweeps.sweep(
    results,
    ["max_chunk=32", "max_chunk=16"],
    base,
    "delta_rule",
    lambda spec: config_from_spec(old, spec),
    "diag_kdn_pallas",
    True,
    "cfg",
    float("inf"),
    sweeps.Sweep(length=40),
  )
  assert [r["ms"] for r in results["sweeps"]] == [None, None] and "cfg" not in results
  assert got is base


def test_seg_rows_pass_document_resets(monkeypatch):
  """*_kdn_seg_<impl> rows run the op with segment_ids: identical to the plain row on the first
  document, different after the first reset."""
  monkeypatch.setattr(arg_specs, "DOC_LEN", 10)
  x = arg_specs.inputs(jax.random.PRNGKey(0), 1, 25, 1, 16, jnp.float32)
  plain, _ = arg_specs.make_jax_fn("diag_kdn_chunked", 16)
  docs, names = arg_specs.make_jax_fn("diag_kdn_seg_chunked", 16)
  assert names == ("q", "k", "v", "la", "om", "r")
  a, b = np.asarray(plain(x)), np.asarray(docs(x))
  np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-6)
  assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-3


def test_stage_split_with_documents(monkeypatch):
  """--stages_docs: the stage split runs every kernel with segment bookkeeping (T not a multiple
  of the chunk, several documents); --sweep_row sweeps the documents row with that split."""
  # (stage_inputs calls segment_arrays in the module that defines both)
  pdr = importlib.import_module("pallas_kernels.delta_rule.inputs")
  monkeypatch.setattr(arg_specs, "DOC_LEN", 10)
  seen = []
  real = pdr.segment_arrays

  def recording(segment_ids, *a):
    out = real(segment_ids, *a)
    seen.append(out[1] is not None and out[2] is not None)
    return out

  monkeypatch.setattr(pdr, "segment_arrays", recording)
  old = dr_config.DeltaRuleConfig()
  results = {}
  sweeps.sweep(
    results,
    ["default"],
    KernelConfigs(delta_rule=old),
    "delta_rule",
    lambda spec: config_from_spec(old, spec),
    "diag_kdn_seg_pallas",
    True,
    "cfg",
    float("inf"),
    _TINY,
    stages=True,
  )
  (rec,) = results["sweeps"]
  assert rec["row"] == "diag_kdn_seg_pallas" and rec["ms"] > 0
  assert seen and all(seen), seen  # the op and the stage split both ran with segments
  assert set(rec["stages"]) == _stage_names(docs=True), rec["stages"]
  assert all(ms > 0 for ms in rec["stages"].values() if not isinstance(ms, dict)), rec["stages"]
  stages = rec["stages"]
  assert stages["bwd/sum"] == pytest.approx(
    sum(ms for name, ms in stages.items() if name.startswith("bwd/") and name != "bwd/sum"),
    abs=0.01,
  )


def test_a_killed_run_keeps_the_cells_it_timed(tmp_path, monkeypatch):
  """results.json is rewritten after every sweep spec and every cell: a run stopped by its time
  limit (here SystemExit, as a SIGTERM handler would raise) keeps what it timed before."""

  def run(kill_at, seq_lens):
    calls = []

    def fake_time(row, t, fwd_bwd, how, first=None, kernels=None):
      calls.append((row, t, fwd_bwd))
      if len(calls) == kill_at:
        raise SystemExit(143)
      return float(len(calls))

    monkeypatch.setattr(timing, "time_jax_row", fake_time)
    out = tmp_path / f"kill{kill_at}"
    cli.FLAGS(
      [
        "bm",
        f"--out={out}",
        "--check=false",
        f"--seq_lens={seq_lens}",
        "--rows=diag_kdn_pallas",
        "--sweep=default,block_v=32",
        "--sweep_combine=false",
        "--nosweep_repeat_first",
      ]
    )
    try:
      with pytest.raises(SystemExit):
        cli.main([])
    finally:
      cli.FLAGS.unparse_flags()
    import json  # pylint: disable=g-import-not-at-top

    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()

  # killed inside the sweep's second spec: the first spec is kept
  res, _ = run(2, "40")
  assert [r["sweep"] for r in res["sweeps"]] == ["default"] and res["rows"] == []
  # killed at the second cell of the first length: the sweep and the first cell are kept
  res, md = run(4, "40,80")
  assert [r["sweep"] for r in res["sweeps"]] == ["default", "block_v=32"]
  assert [(r["row"], r["mode"], r["T"], r["ms"]) for r in res["rows"]] == [
    ("diag_kdn_pallas", "fwd", 40, 3.0)
  ]
  assert "| diag_kdn_pallas | fwd | 3.00 |" in md
  # the kernel configs the rows ran with are recorded beside them
  from pallas_kernels.kdn_gain import config as gain_config  # pylint: disable=g-import-not-at-top

  assert res["gain_config"] == repr(gain_config.GainConfig()) and "Pallas gain config:" in md
