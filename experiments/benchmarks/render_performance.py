"""Renders docs/performance.md from the benchmark JSON under docs/performance/<gpu>/ (never from
typed numbers).

    python -m experiments.benchmarks.render_performance [--perf=docs/performance] \\
        [--out=docs/performance.md]

Each <gpu>/ folder holds up to three records, each {"meta": {...}, "result": {...}}:
  mixers.json      experiments.benchmarks.mixers' results.json: the KDN ops against fla's chunk_kda
  layers.json      experiments.benchmarks.layers' JSON: the KDN layers against fla's
                   KimiDeltaAttention layer
  train_125m.json  the summary.json of a 125M LM training run (steady_tokens_per_s)
  decode.json      experiments.benchmarks.decode's JSON: one decode step of the KDN ops and KDA
                   against fla's fused_recurrent_kda, and generation with the 125M LM
  guard.json       experiments.benchmarks.nonfinite_guard's JSON: what the ops' non-finite guard
                   costs under each scheme, against no guard
"meta" says where the numbers come from: device (the GPU's name), date, command, commit, jax and
optional notes (records carried over from earlier runs have "recorded_in", the commit that added
them, in place of "commit"). `gpu_measurements.sh performance` writes the records through --wrap:

    python -m experiments.benchmarks.render_performance --wrap=<result.json> --command=<cmd> \\
        --device=<GPU name> --out=<record.json>
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess

PARTS = ("mixers", "layers", "train_125m", "decode", "guard")
FLA_OP_ROW = "fla_chunk_kda"
FLA_LAYER_ROW = "fla_kda_layer"
FLA_STEP_ROW = "fla_fused_recurrent_kda"

HEADER = """# Performance against flash-linear-attention

Rendered by `python -m experiments.benchmarks.render_performance` from the JSON under
`docs/performance/<gpu>/` (written by `bash experiments/benchmarks/gpu_measurements.sh performance`);
do not edit by hand. One table per GPU kind, each row with fla in the same process: the KDN ops
(`diag_kdn`, `iso_kdn`, `impl="pallas"`) against fla's `chunk_kda`, and the whole KDN mixer layers
(projections, short convs, gates, memory update, gated norm, output projection; width 2048 = 16
heads x 128) against fla's `KimiDeltaAttention` layer. Ops at B=4, H=16, K=V=128, bf16; times in
ms, medians after warm-up; a ratio below 1 means ours is faster. How the defaults got here:
`docs/decisions.md`.
"""


def load_record(path: str) -> dict:
  """A {"meta", "result"} record; a ValueError names the file and what is missing."""
  with open(path, encoding="utf-8") as f:
    rec = json.load(f)
  if not isinstance(rec, dict) or "meta" not in rec or "result" not in rec:
    raise ValueError(f"{path}: expected an object with 'meta' and 'result' keys")
  for key in ("device", "date", "command"):
    if key not in rec["meta"]:
      raise ValueError(f"{path}: meta.{key} is missing")
  return rec


def _ms(x) -> str:
  return "–" if x is None else f"{x:.2f}"


def _ratio(ours, theirs) -> str:
  return "–" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def _op_rows(result: dict) -> list[tuple]:
  """(T, name, fwd, fla fwd, fwd+bwd, fla fwd+bwd) per Pallas op row and length."""
  ms = {(r["row"], r["mode"], r["T"]): r["ms"] for r in result["rows"]}
  names = sorted({r["row"] for r in result["rows"] if r["row"] != FLA_OP_ROW})
  out = []
  for t in sorted({r["T"] for r in result["rows"]}):
    for name in names:
      if (name, "fwd", t) in ms or (name, "fwd+bwd", t) in ms:
        out.append(
          (
            t,
            name.removesuffix("_pallas"),
            ms.get((name, "fwd", t)),
            ms.get((FLA_OP_ROW, "fwd", t)),
            ms.get((name, "fwd+bwd", t)),
            ms.get((FLA_OP_ROW, "fwd+bwd", t)),
          )
        )
  return out


def _layer_rows(result: dict) -> list[tuple]:
  """(T, name, fwd, fla fwd, fwd+bwd, fla fwd+bwd) per layer row and length."""
  by = {(r["row"], r["T"]): r for r in result["rows"]}
  names = sorted({r["row"] for r in result["rows"] if r["row"] != FLA_LAYER_ROW})
  out = []
  for t in sorted({r["T"] for r in result["rows"]}):
    fla = by.get((FLA_LAYER_ROW, t), {})
    for name in names:
      r = by.get((name, t))
      if r:
        out.append(
          (
            t,
            name.removesuffix("_pallas"),
            r.get("fwd_ms"),
            fla.get("fwd_ms"),
            r.get("fwd_bwd_ms"),
            fla.get("fwd_bwd_ms"),
          )
        )
  return out


def _decode_lines(result: dict) -> list[str]:
  """One decode step per row and batch (us, and the time of fla's step over ours' inverse:
  ratio below 1 = ours faster; a row swept over block_v / num_warps shows its fastest), then the
  generation rows."""
  us, share = {}, {}
  for r in result["steps"]:
    key = (r["row"], r["batch"])
    if "us_per_step" in r and r["us_per_step"] < us.get(key, float("inf")):
      us[key], share[key] = r["us_per_step"], r.get("hbm_share")
  names = sorted({r["row"] for r in result["steps"] if r["row"] != FLA_STEP_ROW})
  batches = sorted({r["batch"] for r in result["steps"]})
  lines = [
    f"One decode step (H = {result['heads']}, K = V = {result['dim']}, fp32 state, "
    f"{result['steps_per_call']} steps per call; us per step; ratio: ours / fla's "
    f"`fused_recurrent_kda`):",
    "",
    "| row | " + " | ".join(f"B={b}" for b in batches) + " |",
    "|---|" + "---|" * len(batches),
  ]
  for name in names + [FLA_STEP_ROW]:
    cells = []
    for b in batches:
      t, f = us.get((name, b)), us.get((FLA_STEP_ROW, b))
      if t is None:
        cells.append("–")
      elif name == FLA_STEP_ROW or not f:
        cells.append(f"{t:.1f}")
      else:
        cells.append(f"{t:.1f} ({t / f:.2f}x)")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  top = batches[-1] if batches else None
  shares = [
    f"{name} {100 * share[(name, top)]:.0f}%"
    for name in names + [FLA_STEP_ROW]
    if share.get((name, top)) is not None
  ]
  if shares:
    lines += ["", f"Share of HBM bandwidth at B={top} (state read and written once): "]
    lines[-1] += ", ".join(shares) + "."
  lines.append("")
  for g in result.get("generation", []):
    if "decode_tokens_per_s" not in g:
      continue
    impl = f", impl {g['impl']}" if "impl" in g else ""
    per_token = (
      f" ({g['ms_per_token']:.2f} ms per token)" if g.get("ms_per_token") is not None else ""
    )
    lines.append(
      f"Generation (`{result.get('lm_config', '?')}`, greedy{impl}): B={g['batch']}, prompt "
      f"{g['prompt_len']}, {g['new_tokens']} new tokens: first token after "
      f"{1e3 * g['time_to_first_token_s']:.0f} ms, then {g['decode_tokens_per_s']:.0f} tokens/s"
      f"{per_token}."
    )
  return lines + [""]


def _guard_lines(result: dict) -> list[str]:
  """The non-finite guard's cost: per op, length and pass, the time without a guard and each
  scheme's time with its change against that."""
  schemes = result.get("schemes") or ["none", "outputs", "inputs"]
  st = result["settings"]
  lines = [
    f"The ops' non-finite guard (`kdn_jax/ops/nonfinite.py`; impl {result['impl']}, B={st['b']}, "
    f"H={st['h']}, K=V={st['d']}, {st['dtype']}; ms, and the change against no guard):",
    "",
    "| op | T | pass | no guard | " + " | ".join(f"`{s}`" for s in schemes[1:]) + " |",
    "|---|---|---|---|" + "---|" * (len(schemes) - 1),
  ]
  for r in result["rows"]:
    base = r["none_ms"]
    cells = [f"{r[s + '_ms']:.3f} ({100 * (r[s + '_ms'] / base - 1):+.1f}%)" for s in schemes[1:]]
    lines.append(
      f"| {r['op']} | {r['t']} | {r['pass_']} | {base:.3f} | " + " | ".join(cells) + " |"
    )
  return lines + [""]


def _source(what: str, rec: dict) -> str:
  m, res = rec["meta"], rec["result"]
  jax_version = m.get("jax") or res.get("jax", "?")
  commit = (
    f", commit {m['commit']}"
    if m.get("commit")
    else f", recorded in {m['recorded_in']}"
    if m.get("recorded_in")
    else ""
  )
  return f"- {what}: `{m['command']}` — {m['device']}, jax {jax_version}, {m['date']}{commit}."


def render_gpu(gpu_dir: str) -> str:
  """The section of one GPU kind: its table, the training line, sources and notes."""
  recs = {}
  for part in PARTS:
    path = os.path.join(gpu_dir, part + ".json")
    if os.path.exists(path):
      recs[part] = load_record(path)
  if not recs:
    raise ValueError(f"{gpu_dir}: none of {', '.join(p + '.json' for p in PARTS)}")
  device = next(iter(recs.values()))["meta"]["device"]
  lines = [f"## {device}", ""]
  rows = []
  if "mixers" in recs:
    rows += [("op vs `chunk_kda`",) + r for r in _op_rows(recs["mixers"]["result"])]
  if "layers" in recs:
    rows += [("layer vs `KimiDeltaAttention`",) + r for r in _layer_rows(recs["layers"]["result"])]
  if rows:
    lines += [
      "| what | T | ours | fwd | fla fwd | fwd / fla | fwd+bwd | fla fwd+bwd | fwd+bwd / fla |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for what, t, name, f, ff, fb, ffb in rows:
      lines.append(
        f"| {what} | {t} | {name} | {_ms(f)} | {_ms(ff)} | {_ratio(f, ff)} | {_ms(fb)} "
        f"| {_ms(ffb)} | {_ratio(fb, ffb)} |"
      )
    lines.append("")
  if "train_125m" in recs:
    s = recs["train_125m"]["result"]
    lines += [
      f"125M LM training (`configs/lm_125m.py:default`, {s['num_params'] / 1e6:.1f}M parameters, "
      f"one GPU): **{s['steady_tokens_per_s'] / 1e3:.1f}k tokens/s** (median of the logged "
      f"intervals after the first step, {s['num_steps']} steps).",
      "",
    ]
  if "decode" in recs:
    lines += _decode_lines(recs["decode"]["result"])
  if "guard" in recs:
    lines += _guard_lines(recs["guard"]["result"])
  lines.append("Sources:")
  for part, what in (
    ("mixers", "ops"),
    ("layers", "layers"),
    ("train_125m", "training"),
    ("decode", "decode"),
    ("guard", "non-finite guard"),
  ):
    if part in recs:
      lines.append(_source(what, recs[part]))
  notes = [n for rec in recs.values() for n in rec["meta"].get("notes", [])]
  if notes:
    lines += ["", "Notes:"] + [f"- {n}" for n in notes]
  return "\n".join(lines) + "\n"


def render(perf_dir: str) -> str:
  """docs/performance.md from every <gpu>/ folder under perf_dir, in name order."""
  gpus = sorted(d for d in os.listdir(perf_dir) if os.path.isdir(os.path.join(perf_dir, d)))
  if not gpus:
    raise ValueError(f"{perf_dir}: no <gpu>/ folders with benchmark records")
  return "\n".join([HEADER] + [render_gpu(os.path.join(perf_dir, g)) for g in gpus])


def _git_commit() -> str | None:
  try:
    out = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() or None
  except (OSError, subprocess.CalledProcessError):
    return None


def wrap(result_path: str, command: str, device: str, out_path: str, notes=()) -> dict:
  """Writes {"meta", "result"} for one benchmark's JSON output to out_path and returns it."""
  if not os.path.exists(result_path):
    raise FileNotFoundError(f"--wrap: {result_path} does not exist (did the benchmark time out?)")
  if not device:
    raise ValueError("--device: the GPU's name is required (nvidia-smi --query-gpu=name)")
  with open(result_path, encoding="utf-8") as f:
    result = json.load(f)
  try:
    jax_version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    jax_version = result.get("jax")
  meta = {
    "device": device,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    "command": command,
    "commit": _git_commit(),
    "jax": jax_version,
  }
  if notes:
    meta["notes"] = list(notes)
  rec = {"meta": meta, "result": result}
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(rec, f, indent=1)
    f.write("\n")
  return rec


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--perf", default="docs/performance", help="folder of <gpu>/ record folders")
  p.add_argument(
    "--out", default="docs/performance.md", help="rendered file (or, with --wrap, the record)"
  )
  p.add_argument("--wrap", default="", help="a benchmark's JSON output to wrap into a record")
  p.add_argument("--command", default="", help="with --wrap: the command that wrote it")
  p.add_argument("--device", default="", help="with --wrap: the GPU's name")
  a = p.parse_args(argv)
  if a.wrap:
    wrap(a.wrap, a.command, a.device, a.out)
    print(f"wrote {a.out}")
    return
  md = render(a.perf)
  tmp = a.out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(md)
  os.replace(tmp, a.out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
