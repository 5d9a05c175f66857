"""experiments/evaluate.py and experiments/evaluation: chunked carry == one forward, position-wise PPL
averages to perplexity, EffRem bounds, the beta_eff probe == the op's gain, every suite on a checkpoint of
a tiny corpus LM (files written, settings recorded), and clear errors before any work."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from runner_helpers import train_tiny_lm

from experiments import loading
from experiments.data import token_files
from experiments.evaluation import long_context, probes, suites
from experiments.evaluation.runner import evaluate
from kdn_jax import ops
from kdn_jax.models.config import model_config
from kdn_jax.models.lm import LanguageModel


def _model(layer_pattern="kdn_diag,swa,kdn_iso,attention", num_layers=4):
  cfg = model_config(
    "tiny",
    mixer="kdn_diag",
    layer_pattern=layer_pattern,
    vocab_size=32,
    num_layers=num_layers,
    d_model=32,
    num_heads=2,
    head_dim=8,
    mlp_hidden=32,
    chunk_size=8,
    swa_window=8,
    impl="chunked",
  )
  return LanguageModel(cfg, rngs=nnx.Rngs(0))


def test_chunked_carry_equals_one_forward():
  scorer = long_context.ChunkedScorer(_model())
  rng = np.random.default_rng(0)
  x = rng.integers(0, 32, size=(2, 45)).astype(np.int32)
  y = rng.integers(0, 32, size=(2, 45)).astype(np.int32)
  nll1, c1 = scorer.one_shot(x, y)
  seen = []
  nll2, c2 = scorer.score(x, y, chunk=16, on_chunk=lambda t, cache: seen.append(t))
  np.testing.assert_allclose(nll2, nll1, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(c2, c1)
  assert seen == [16, 32, 45]


def test_effrem_is_zero_at_t0_and_bounded():
  scorer = long_context.ChunkedScorer(_model("kdn_diag,attention", num_layers=2))
  seqs = np.random.default_rng(1).integers(0, 32, size=(3, 24)).astype(np.int32)
  ts = long_context.effrem_grid(24, 7)
  er = long_context.effective_remembrance(scorer, seqs, ts, batch=4)
  assert er.shape == (3, len(ts)) and ts[0] == 0
  np.testing.assert_allclose(er[:, 0], 0.0, atol=1e-6)
  assert np.all(er >= 0) and np.all(er <= 1) and er[:, -1].min() > 1e-4
  # the cut really drops the prefix: one row, suffix from the initial state
  t = int(ts[3])
  alone = jax.nn.softmax(scorer.logits(seqs[:1, t:])[0, -1])
  full = jax.nn.softmax(scorer.logits(seqs[:1])[0, -1])
  np.testing.assert_allclose(er[0, 3], 0.5 * float(jnp.abs(full - alone).sum()), atol=1e-5)


def test_effrem_packed_suffixes_equal_suffixes_run_alone():
  """Every cut's suffix, packed beside others as a segment with the head read at its end, predicts what
  it predicts run alone (a cut grid without t = 0 and with short suffixes that share rows)."""
  scorer = long_context.ChunkedScorer(_model("kdn_iso,swa", num_layers=2))
  seqs = np.random.default_rng(3).integers(0, 32, size=(2, 20)).astype(np.int32)
  ts = np.array([5, 12, 17, 19])
  er = long_context.effective_remembrance(scorer, seqs, ts, batch=3)
  full = jax.nn.softmax(scorer.logits(seqs)[:, -1])
  for j, t in enumerate(ts):
    alone = jax.nn.softmax(scorer.logits(seqs[:, t:])[:, -1])
    np.testing.assert_allclose(er[:, j], 0.5 * np.abs(full - alone).sum(-1), atol=1e-5)


def test_state_series_equals_the_scored_pass(monkeypatch):
  """The states at chunk ends read from multi-chunk forwards (prefix states) equal the chunked scored
  pass's, pieces of two chunks and a short last chunk included."""
  monkeypatch.setattr(long_context, "STATE_PIECE_TOKENS", 32)
  scorer = long_context.ChunkedScorer(_model("kdn_diag,kda", num_layers=2))
  x = np.random.default_rng(4).integers(0, 32, size=(2, 45)).astype(np.int32)
  scored, read = [], []
  scorer.score(x, x, chunk=16, on_chunk=lambda t, c: scored.append((t, probes.state_stats(c))))
  scorer.state_series(x, 16, lambda t, c: read.append((t, probes.state_stats(c))))
  assert [t for t, _ in read] == [t for t, _ in scored] == [16, 32, 45]
  for (_, a), (_, b) in zip(read, scored):
    for la, lb in zip(a, b):
      assert la.keys() == lb.keys()
      for key in la:
        assert la[key] == pytest.approx(lb[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mixer", ["kdn_diag", "kdn_iso"])
def test_beta_eff_probe_equals_the_gain_of_the_op(mixer):
  model = _model(mixer, num_layers=1)
  tokens = np.random.default_rng(2).integers(0, 32, size=(2, 19)).astype(np.int32)
  seg = np.repeat(np.array([[0] * 7 + [1] * 12]), 2, axis=0)
  beta = probes.write_strengths(model, tokens, seg)[0]
  mix = model.blocks[0].mixer
  x = model.mixer_inputs(jnp.asarray(tokens), segment_ids=jnp.asarray(seg))[0]
  st = mix.init_state(2)
  _, k, _, _ = mix.project(x, st["conv"], jnp.asarray(seg))
  g = mix._gates(x)  # pylint: disable=protected-access
  kf = k.astype(jnp.float32)
  if mixer == "kdn_diag":
    kappa, _ = ops.variance.diag_gain(
      kf, g["log_alpha"], g["omega"], g["r"], mix.info_scale(), st["variance"], jnp.asarray(seg)
    )
    want = jnp.sum(kf * kappa, -1)  # k^T kappa = z / (r + z)
  else:
    b, _ = ops.variance.iso_gain(
      kf, g["log_alpha"], g["omega"], g["r"], mix.info_scale(), st["variance"], jnp.asarray(seg)
    )
    want = b * jnp.sum(kf * kf, -1)
  np.testing.assert_allclose(beta, np.asarray(want), rtol=1e-5, atol=1e-6)
  assert beta.shape == (2, 19, 2) and np.all((beta > 0) & (beta < 1))


def test_spread_windows_cover_documents_from_a_seed():
  """One window per document first, documents in a seeded order (not file order), more per
  document only when documents run out; every window starts its document (after the separator)."""
  lens = [50, 10, 300, 120, 80, 45]
  off = np.concatenate([[0], np.cumsum(lens)])
  tokens = np.arange(off[-1]) % 97 + 1
  w, which = long_context.spread_windows(tokens, off, 40, 0, 4, seed=1)
  assert w.shape == (4, 41) and len(set(which)) == 4 and 1 not in which  # 10 tokens: too short
  for row, i in zip(w, which):
    assert row[0] == 0 and np.array_equal(row[1:], tokens[off[i] : off[i] + 40])
  orders = {tuple(long_context.spread_windows(tokens, off, 40, 0, 5, seed=s)[1]) for s in range(6)}
  assert len(orders) > 1  # the seed picks the order
  w, which = long_context.spread_windows(tokens, off, 40, 0, 9, seed=0)
  assert len(w) == 9 and sorted(set(which)) == [0, 2, 3, 4, 5]  # second round: the longer ones
  with pytest.raises(ValueError, match="no document holds 401 tokens"):
    long_context.spread_windows(tokens, off, 400, 0, 2)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  return train_tiny_lm(tmp_path_factory.mktemp("eval"))


def test_evaluate_every_suite_on_a_checkpoint(lm_run):
  workdir, _ = lm_run
  before = {
    f: os.path.getmtime(os.path.join(workdir, f)) for f in ("metrics.jsonl", "summary.json")
  }
  s = suites.Settings(
    max_len=256,
    chunk=64,
    num_sequences=3,
    effrem_points=5,
    effrem_sequences=2,
    batch=4,
    retrieval_lengths=(256,),
    retrieval_examples=2,
  )
  names = [n for n in suites.SUITES if n not in suites.TOPIC_ONLY]
  res = evaluate(workdir, names, s)
  out = os.path.join(workdir, "eval")
  for name in names:
    with open(os.path.join(out, f"{name}.json"), encoding="utf-8") as f:
      rec = json.load(f)
    assert rec["meta"]["step"] == 3 and rec["meta"]["settings"]["max_len"] == 256, name
  for png in (
    "position_ppl",
    "effrem",
    "state_stats",
    "beta_eff",
    "retrieval_snih1",
    "retrieval_snih2",
    "retrieval_snih3",
  ):
    assert os.path.getsize(os.path.join(out, f"{png}.png")) > 1000, png
  # position-wise perplexity averaged over positions is the perplexity of those sequences
  pp = res["position_ppl"]
  per_pos = np.load(os.path.join(out, "position_nll.npy"))
  assert per_pos.shape == (256,)
  tokens = token_files.load_tokens(os.path.join(lm_run[1], "long_eval.npy"))
  off = token_files.load_offsets(os.path.join(lm_run[1], "long_eval.npy"), tokens)
  seqs, _ = long_context.spread_windows(tokens, off, 256, 0, 3, seed=0)
  scorer = long_context.ChunkedScorer(loading.load(workdir).model)
  nll, _ = scorer.one_shot(seqs[:, :-1], seqs[:, 1:])
  np.testing.assert_allclose(pp["perplexity"], np.exp(nll.mean()), rtol=1e-4)
  np.testing.assert_allclose(np.exp(per_pos.mean()), pp["perplexity"], rtol=1e-5)
  # the ratio PPL@max_len / PPL@T and the bucket bands, with intervals over the windows
  r = pp["ratio"]
  assert (r["long_len"], r["train_len"], r["units"]) == (256, 32, 3)
  np.testing.assert_allclose(r["estimate"], pp["ppl_at"]["256"] / pp["ppl_at"]["32"], rtol=1e-5)
  assert r["lo"] <= r["estimate"] <= r["hi"]
  # the per-window bucket means (compare's bootstrap units) and which windows they were
  per_window = np.asarray(pp["bucket_nll_per_sequence"])
  assert per_window.shape == (3, len(pp["bucket_ppl"]))
  np.testing.assert_allclose(np.exp(per_window.mean(0)), pp["bucket_ppl"], rtol=1e-5)
  assert pp["examples_hash"] == suites.examples_hash(seqs) != suites.examples_hash(seqs[:2])
  assert res["effrem"]["examples_hash"] != pp["examples_hash"]  # other windows (length 128)
  assert np.all(np.asarray(pp["bucket_ppl_lo"]) <= np.asarray(pp["bucket_ppl"]) * (1 + 1e-6))
  assert np.all(np.asarray(pp["bucket_ppl_hi"]) >= np.asarray(pp["bucket_ppl"]) * (1 - 1e-6))
  assert res["state_stats"]["series"][0]["t"] == 0 and res["state_stats"]["series"][-1]["t"] == 256
  assert res["state_stats"]["series"][0]["layers"][1] is None  # attention has no recurrent state
  assert "variance_mean" in res["state_stats"]["series"][-1]["layers"][0]
  assert set(res["beta_eff"]["layers"]) == {"0"} and 0 < res["beta_eff"]["all"]["mean"] < 1
  assert res["effrem"]["mean"][0] == pytest.approx(0.0, abs=1e-6)
  cells = res["retrieval"]["tasks"]
  assert set(cells) == {"snih1", "snih2", "snih3"} and all(len(v) == 5 for v in cells.values())
  assert np.isfinite(res["ppl"]["perplexity"]) and res["ppl"]["tokens"] > 0
  after = {f: os.path.getmtime(os.path.join(workdir, f)) for f in before}
  assert after == before  # the run's own records are untouched


def test_evaluate_errors_before_work(lm_run, tmp_path):
  workdir, _ = lm_run
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="workdir: no checkpoint"):
    evaluate(str(tmp_path / "empty"), ["ppl"])
  with pytest.raises(FileNotFoundError, match="step: no checkpoint for step 7"):
    evaluate(workdir, ["ppl"], step=7)
  with pytest.raises(ValueError, match=r"--suite: unknown suite\(s\) \['nope'\]"):
    evaluate(workdir, ["nope"])
  with pytest.raises(ValueError, match=r"--max_len: the longest long-eval document has \d+ tokens"):
    evaluate(
      workdir, ["position_ppl"], suites.Settings(max_len=100_000), out_dir=str(tmp_path / "o")
    )
  with pytest.raises(ValueError, match="--max_len: 8 is shorter than the training length 32"):
    evaluate(workdir, ["position_ppl"], suites.Settings(max_len=8), out_dir=str(tmp_path / "o"))
  assert not os.path.exists(tmp_path / "o")  # nothing written on a refused evaluation


def test_cli_reports_bad_input_with_exit_code_2(lm_run):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run(
    [sys.executable, "-m", "experiments.evaluate", f"--workdir={lm_run[0]}", "--suite=nope"],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 2 and "--suite: unknown suite(s) ['nope']" in out.stderr, out.stderr[
    -2000:
  ]


def test_cli_all_steps_evaluates_every_checkpoint(lm_run, tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  steps = loading.saved_steps(lm_run[0])
  assert steps and steps[-1] == 3
  cmd = [sys.executable, "-m", "experiments.evaluate", f"--workdir={lm_run[0]}", "--suite=ppl"]
  out = subprocess.run(
    cmd + ["--all_steps", f"--out={tmp_path}"],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  for step in steps:
    with open(tmp_path / f"step{step}" / "ppl.json", encoding="utf-8") as f:
      assert json.load(f)["meta"]["step"] == step


def test_info_scale_override_changes_only_mu(lm_run, tmp_path):
  """The fixed-weight beta_eff probe: the trained parameters, mu replaced; beta_eff falls as mu grows."""
  workdir, _ = lm_run
  base = loading.load(workdir)
  params = nnx.to_pure_dict(nnx.state(base.model, nnx.Param))
  means = {}
  for mu in ("1", "k", "4k"):
    run = loading.load(workdir, model_overrides={"info_scale": mu})
    got = nnx.to_pure_dict(nnx.state(run.model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, got, params)  # the same parameters, bit for bit
    changed = {k for k in base.config.model if base.config.model[k] != run.config.model[k]}
    assert (
      changed <= {"info_scale"}
      and run.model.blocks[0].mixer.info_scale() == {"1": 1.0, "k": 8.0, "4k": 32.0}[mu]
    )
    means[mu] = evaluate(
      workdir, ["beta_eff"], suites.Settings(batch=4), model_overrides={"info_scale": mu}
    )["beta_eff"]["all"]["mean"]
    with open(
      os.path.join(workdir, "eval", f"info_scale_{mu}", "beta_eff.json"), encoding="utf-8"
    ) as f:
      assert json.load(f)["meta"]["model_overrides"] == {"info_scale": mu}
  assert means["1"] > means["k"] > means["4k"]
  default = evaluate(
    workdir, ["beta_eff"], suites.Settings(batch=4), out_dir=str(tmp_path / "plain")
  )
  assert default["beta_eff"]["all"]["mean"] == pytest.approx(
    means["k"], rel=1e-6
  )  # the run's own mu = K
  with pytest.raises(ValueError, match="--override_info_scale: expected one of"):
    loading.load(workdir, model_overrides={"info_scale": "big"})
  with pytest.raises(ValueError, match="--override_info_scale: expected one of"):
    loading.load(workdir, model_overrides={"info_scale": "learned"})


def test_default_lm_suites_gate_sniah_on_its_shortest_length(lm_run):
  """Default suites: an S-NIAH task that retrieves nothing at its shortest length is not scored longer,
  and the result says why; a run without a tokenizer leaves retrieval out with a reason."""
  workdir, _ = lm_run
  run = loading.load(workdir)
  # (S-NIAH-3 needs >= 267 tokens with this tokenizer; the validation haystack has 2695)
  s = suites.Settings(retrieval_lengths=(320, 640), retrieval_examples=2, batch=4)
  ctx = suites.Context(run, long_context.ChunkedScorer(run.model), s)
  assert "retrieval" in suites.default_suites(ctx) and suites.default_skips(ctx) == {}
  res = suites.run_retrieval(ctx, gate=True)
  for task, rows in res["tasks"].items():
    shortest = [r for r in rows if r["length"] == 320]
    if any(r["exact_match"] > 0 for r in shortest):
      assert task not in res.get("skipped", {}) and {r["length"] for r in rows} == {320, 640}
    else:
      assert rows == shortest and "lengths [640] not scored" in res["skipped"][task]
  assert res.get("skipped"), "a 3-step model retrieves nothing: at least one task is gated"
  # (explicit --suite=retrieval scores every cell: test_evaluate_every_suite_on_a_checkpoint)
  bare = loading.LoadedRun(run.workdir, run.config, run.model, run.step, run.checkpoint, None)
  ctx = suites.Context(bare, ctx.scorer, s)
  assert "retrieval" not in suites.default_suites(ctx)
  assert "S-NIAH needs the corpus tokenizer" in suites.default_skips(ctx)["retrieval"]


def test_headline_keeps_mqar_kv_counts_apart_and_formats_p_star(tmp_path):
  from experiments.evaluation import plots, runner  # pylint: disable=g-import-not-at-top

  rows = [
    {"axis": "num_kv_pairs", "num_kv_pairs": kv, "length": n, "token_accuracy": acc}
    for kv, n, acc in ((8, 64, 0.74), (16, 64, 0.33), (8, 128, 0.70), (16, 128, 0.30))
  ]
  assert runner.retrieval_headline("mqar", rows) == [
    "mqar token accuracy (num_kv_pairs 8) by length: 64: 0.74, 128: 0.70",
    "mqar token accuracy (num_kv_pairs 16) by length: 64: 0.33, 128: 0.30",
  ]
  pp = {
    "perplexity": 230.1,
    "max_len": 4096,
    "p_star": 225.69646979944798,
    "t_star": 700.5,
    "p_star_log_se": 0.05,
    "sequences": 16,
    "p_star_buckets": 9,
    "generalises_to": 2048.0,
  }
  line = runner._headline({"position_ppl": pp})[0]  # pylint: disable=protected-access
  assert (
    "p* 225.70 at t* 700 (x/ 1.051 one standard error over 16 sequences; the best of 9 noisy buckets"
    in line
  )
  # state_stats: one panel row per layer with a state (attention's None skipped), markers only
  series = [
    {"t": t, "layers": [{"memory_norm": 1.0 + t, "memory_std": 0.1}, None]} for t in (0, 64, 128)
  ]
  path = plots.state_stats(
    {"series": series, "train_len": 64, "chunk": 64, "sequences": 2}, str(tmp_path / "s.png")
  )
  assert os.path.getsize(path) > 1000


def test_damaged_inputs_are_one_line_before_work(lm_run, tmp_path, capfd):
  """A checkpoint with truncated array data (named with the other steps), a garbage record (named by
  file), a truncated tokenizer (named by file) and an --out that is a file: one ValueError line each, no
  orbax traceback, nothing written."""
  import shutil  # pylint: disable=g-import-not-at-top

  from experiments import evaluate as evaluate_cli  # pylint: disable=g-import-not-at-top

  workdir, cdir = lm_run
  with pytest.raises(ValueError, match="--out=.*summary.json: is a file; expected a directory"):
    evaluate_cli.check_out(os.path.join(workdir, "summary.json"))
  tok = tmp_path / "tokenizer.json"
  data = open(os.path.join(cdir, "tokenizer.json"), "rb").read()
  tok.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match=f"--tokenizer: '{tok}' is not a readable tokenizer.json"):
    evaluate(
      workdir, ["retrieval"], suites.Settings(tokenizer=str(tok)), out_dir=str(tmp_path / "o")
    )
  damaged = tmp_path / "run"
  shutil.copytree(workdir, damaged)
  step = loading.saved_steps(str(damaged))[-1]
  state = damaged / "checkpoints" / str(step) / "state"
  # (to nothing: a file cut in half can leave the parameters whole, where the optimizer state
  # sits in the lost half, and evaluation reads only the parameters)
  for path in state.glob("ocdbt.process_0/d/*"):
    os.truncate(path, 0)
  capfd.readouterr()
  with pytest.raises(
    ValueError, match=rf"checkpoints/{step} is unreadable \(.*\); (other saved steps|no other step)"
  ):
    evaluate(str(damaged), ["ppl"], out_dir=str(tmp_path / "o"))
  assert "Traceback" not in capfd.readouterr().err
  record = damaged / "checkpoints" / str(step) / "record" / "metadata"
  record.write_text("garbage")
  with pytest.raises(ValueError, match=f"{record}: not a readable checkpoint record"):
    evaluate(str(damaged), ["ppl"], out_dir=str(tmp_path / "o"))
  assert not os.path.exists(tmp_path / "o")
