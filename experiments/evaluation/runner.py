"""Runs evaluation suites on a checkpoint and writes their JSON, plots and summary (the library behind
``python -m experiments.evaluate``; importable without that CLI's absl flags)."""

from __future__ import annotations

import os
import time

import numpy as np

from experiments import loading
from experiments.evaluation import long_context, plots
from experiments.evaluation import suites as S
from experiments.runner import logging_utils
from kdn_jax.layers.options import option


def evaluate(
  workdir: str,
  suites=None,
  settings=None,
  step=None,
  out_dir: str = "",
  model_overrides: dict | None = None,
) -> dict:
  """Runs ``suites`` on ``workdir``'s checkpoint; writes <out_dir>/<suite>.json, PNGs and summary.json.

  ``model_overrides`` (``{'info_scale': mu}``): the same parameters in a model built with that mu (the
  fixed-weight beta_eff probe); the default ``out_dir`` is then ``<workdir>/eval/info_scale_<mu>``."""
  settings = settings or S.Settings()
  run = loading.load(workdir, step, settings.tokenizer or None, model_overrides=model_overrides)
  if model_overrides and not out_dir:
    out_dir = os.path.join(run.workdir, "eval", f"info_scale_{run.config.model.info_scale}")
  # (the run's kernel options, speed only, are in its model: loading builds it with them)
  return _evaluate(run, suites, settings, out_dir, model_overrides)


def _evaluate(run, suites, settings, out_dir, model_overrides=None):
  workdir = run.workdir  # (the run directory also when a checkpoint directory was given)
  ctx = S.Context(run, long_context.ChunkedScorer(run.model), settings)
  gate = not suites and ctx.is_lm  # S-NIAH past its shortest length only where it scores there
  skips = {} if suites else S.default_skips(ctx)
  suites = list(suites or S.default_suites(ctx))
  S.check(ctx, suites)
  out_dir = out_dir or os.path.join(workdir, "eval")
  os.makedirs(out_dir, exist_ok=True)
  print(
    f"Evaluating {run.checkpoint} ({run.config.model.get('mixer')}, trained on {run.config.data.kind}, "
    f"length {ctx.train_len}): {', '.join(suites)} -> {out_dir}",
    flush=True,
  )
  for name, why in skips.items():
    print(f"{name}: not run: {why}", flush=True)
  meta = {
    "workdir": os.path.abspath(workdir),
    "checkpoint": run.checkpoint,
    "step": run.step,
    "mixer": run.config.model.get("mixer"),
    "layer_pattern": run.config.model.get("layer_pattern"),
    "initial_state": run.config.train.initial_state,
    "train_len": ctx.train_len,
    "info_scale": str(option(run.config.model, "info_scale")),
    "model_overrides": dict(model_overrides or {}),
    "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(settings).items()},
  }
  results, times = {}, {}

  def done(name, res, t0):
    times[name] = time.time() - t0
    res = {**res, "meta": meta, "wall_time_s": times[name]}
    results[name] = res
    logging_utils.write_json(os.path.join(out_dir, f"{name}.json"), res)
    print(f"{name}: done in {logging_utils.fmt_time(times[name])}", flush=True)

  for name in suites:
    t0 = time.time()
    if name == "position_ppl":
      res, stats, per_pos = S.position_ppl(ctx)
      S.write_npy(os.path.join(out_dir, "position_nll.npy"), per_pos.astype(np.float32))
      done(name, res, t0)
      if "state_stats" not in results:
        done("state_stats", stats, t0)
    elif name == "topic_floor":
      res, stats = S.topic_floor(ctx)
      done(name, res, t0)
      if "state_stats" not in results:
        done("state_stats", stats, t0)
    elif name == "state_stats":
      if "state_stats" not in results:
        done(name, S.state_stats(ctx), t0)
    elif name == "retrieval":
      done(name, S.run_retrieval(ctx, gate), t0)
    else:
      done(name, getattr(S, name)(ctx), t0)
  pngs = plots.save_all(out_dir, results)
  summary = {
    **meta,
    "suites": list(results),
    "wall_time_s": times,
    "plots": [os.path.basename(p) for p in pngs],
    "headline": _headline(results),
  }
  logging_utils.write_json(os.path.join(out_dir, "summary.json"), summary)
  for line in _headline(results):
    print(line, flush=True)
  print(f"Wrote {len(results)} JSON files and {len(pngs)} plots to {out_dir}", flush=True)
  return results


def _headline(results) -> list[str]:
  lines = []
  if "ppl" in results:
    lines.append(f"validation perplexity {results['ppl']['perplexity']:.3f}")
  if "position_ppl" in results:
    r = results["position_ppl"]
    line = f"position-wise: PPL {r['perplexity']:.3f} over {r['max_len']} tokens"
    if r["p_star"] is not None:
      line += (
        f"; p* {r['p_star']:.2f} at t* {r['t_star']:.0f} (x/ {np.exp(r['p_star_log_se']):.3f} one standard "
        f"error over {r['sequences']} sequences; the best of {r['p_star_buckets']} noisy buckets, so "
        f"biased low); within p* up to t = {r['generalises_to']:.0f}"
      )
    lines.append(line)
  if "topic_floor" in results:
    r = results["topic_floor"]
    (ea, eb), (la, lb) = r["early_window"], r["late_window"]
    lines.append(
      f"excess NLL over the floor: [{ea}, {eb}) {_fmt_iv(r['early'])}, "
      f"[{la}, {lb}) {_fmt_iv(r['late'])}; model PPL late / early {_fmt_iv(r['ppl_ratio'])}: "
      f"{r['verdict']}"
    )
  if "effrem" in results:
    r = results["effrem"]
    lines.append(
      f"EffRem_T (T={r['T']}): t=0 {r['mean'][0]:.3f}, middle {r['mean'][len(r['mean']) // 2]:.3f}, "
      f"last {r['mean'][-1]:.3f}"
    )
  if "beta_eff" in results and "all" in results["beta_eff"]:
    lines.append(f"beta_eff mean {results['beta_eff']['all']['mean']:.3f}")
  for task, rows in results.get("retrieval", {}).get("tasks", {}).items():
    lines += retrieval_headline(task, rows)
  return lines


def _fmt_iv(iv: dict) -> str:
  return f"{iv['estimate']:.4f} [{iv['lo']:.4f}, {iv['hi']:.4f}]"


def retrieval_headline(task: str, rows: list[dict]) -> list[str]:
  """One line per value of a difficulty axis (MQAR's key-value pairs: the heatmap's rows, never averaged
  together); S-NIAH / passkey depths are averaged (where the needle sits, not how hard the task is)."""
  metric = plots.METRIC[task]
  what = metric.replace("_", " ")
  if not rows:
    return []
  axis = rows[0]["axis"]
  split = task == "mqar"
  groups = {}
  for r in rows:
    groups.setdefault(r[axis] if split else None, {}).setdefault(r["length"], []).append(r[metric])
  out = []
  for point, by_len in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0])):
    head = f"{task} {what}" + (
      f" ({axis} {point})"
      if split
      else (
        f" (mean over {len(next(iter(by_len.values())))} {axis} values)"
        if len(next(iter(by_len.values()))) > 1
        else ""
      )
    )
    out.append(
      f"{head} by length: " + ", ".join(f"{n}: {np.mean(v):.2f}" for n, v in sorted(by_len.items()))
    )
  return out
