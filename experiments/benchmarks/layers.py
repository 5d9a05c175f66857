r"""Whole-layer timing: kdn_jax mixer layers against fla's KimiDeltaAttention layer.

A layer here is everything in `kdn_jax.layers` (registry.MIXERS): q/k/v projections, causal short
conv, gates (decay, noise / beta), the memory update (`impl` = chunked or pallas), the gated RMSNorm
output and o_proj. `fla_kda_layer` is flash-linear-attention 0.6.0's `fla.layers.KimiDeltaAttention`
(mode='chunk') in PyTorch under bf16 autocast. Default shape, the paper's: batch 4, width 2048,
16 heads x 128, bf16 compute, float32 params; forward and forward+backward (gradients of
sum(y * cotangent) w.r.t. the input and all params); median of --reps runs after --warmup.

GPU (device tool, carry=[".whl"]; fla, fla_core and ml_collections come as wheels):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m experiments.benchmarks.layers \
      --impls=chunked,pallas --time_budget_s=480 --out=$OUT/layers

CPU smoke (what tests/benchmarks/test_benchmark_layers.py runs):
  python -m experiments.benchmarks.layers --batch=1 --width=32 --num_heads=2 --head_dim=16 \
      --seq_lens=32 --chunk_size=16 --reps=1 --warmup=0 --out=/tmp/bench_layers

Writes <out>.json, <out>.md and <out>.png (log-log time vs T) after every cell.
"""

from __future__ import annotations

import json
import time
import traceback

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from flax import nnx

from experiments import kernel_config
from experiments.benchmarks.timing import (
  import_for_cuda,
  markdown_table,
  median_time,
  torch_cuda_median_ms,
)
from experiments.runner import cli
from kdn_jax.layers.registry import MIXERS, make_mixer
from kdn_jax.models.config import model_config

FLA_ROW = "fla_kda_layer"
JAX_MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet")

# From the issue (PyTorch layers on the authors' GPU, batch 4, width 2048): not measured here.
ANCHORS = {  # name -> {T: (fwd ms, fwd+bwd ms)}
  "fla KDA layer": {4096: (3.35, 11.1), 16384: (8.35, 36.6)},
  "KDN authors' diag layer": {4096: (3.61, 13.9), 16384: (12.8, 49.4)},
  "KDN authors' iso layer": {4096: (2.52, 11.2), 16384: (8.52, 37.0)},
}
PAPER_SHAPE = dict(batch=4, width=2048, num_heads=16, head_dim=128)  # the anchors' shape
# The layer bars (time / fla KDA layer's, at most): (mixer, timing key, bound).
TARGETS = tuple(
  (mixer, key, bound)
  for mixer in ("kdn_diag", "kdn_iso")
  for key, bound in (("fwd_bwd_ms", 0.9), ("fwd_ms", 1.1))
)

FLAGS = flags.FlagValues()
flags.DEFINE_string(
  "out",
  "/tmp/benchmark_layers",
  "output prefix: <out>.json, <out>.md, <out>.png",
  flag_values=FLAGS,
)
flags.DEFINE_list("seq_lens", ["4096", "16384"], "sequence lengths T", flag_values=FLAGS)
flags.DEFINE_list(
  "rows",
  list(JAX_MIXERS) + [FLA_ROW],
  "kdn_jax mixer names and/or fla_kda_layer",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "impls",
  ["chunked"],
  "memory-update impls of the kdn_jax rows (chunked, pallas)",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "fusion",
  ["on"],
  "pallas rows with the layer's fused glue kernels 'on' (the default "
  "path), and/or 'off' (rows <mixer>_pallas_unfused: the plain-JAX glue), or single "
  "pieces 'front', 'conv', 'norm' (rows <mixer>_pallas_<piece>: only that one on)",
  flag_values=FLAGS,
)
kernel_config.define_flags(FLAGS)  # --delta_rule_config, --gain_config, --conv_config
flags.DEFINE_integer("batch", 4, "batch size", flag_values=FLAGS)
flags.DEFINE_integer("width", 2048, "d_model / hidden_size", flag_values=FLAGS)
flags.DEFINE_integer("num_heads", 16, "heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer(
  "chunk_size", 64, "memory chunk length of the kdn_jax layers", flag_values=FLAGS
)
flags.DEFINE_integer("reps", 30, "timed runs (median reported)", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "untimed runs after the compiling call", flag_values=FLAGS)
flags.DEFINE_float(
  "time_budget_s", 420.0, "start no new cell after this many seconds", flag_values=FLAGS
)


FUSED_PIECES = ("front", "conv", "norm")  # RecurrentMixer / KDNMixer fuse_<piece> switches


def set_fusion(layer, fusion):
  """'on': the layer's defaults; 'off': every fused glue kernel off; a piece name: that one only."""
  if fusion == "on":
    return
  for piece in FUSED_PIECES:
    if hasattr(layer, "fuse_" + piece):
      setattr(layer, "fuse_" + piece, fusion == piece)


def layer_fns(mixer, impl, t, s, fusion="on", dtype="bfloat16", kernels=None):
  """(jitted fwd, jitted fwd+bwd, (params, x), ct) of one kdn_jax layer; fwd+bwd takes
  (params, x, ct) and returns the gradients of sum(y * ct) w.r.t. params and x. kernels: the
  layer's pallas_kernels.KernelConfigs (None: the tuned configs)."""
  cfg = model_config(
    "tiny",
    d_model=s["width"],
    num_heads=s["num_heads"],
    head_dim=s["head_dim"],
    mixer=mixer,
    impl=impl,
    chunk_size=s["chunk_size"],
    dtype=dtype,
    param_dtype="float32",
    mlp_hidden=1,
  )
  layer = make_mixer(mixer, cfg, rngs=nnx.Rngs(0), kernel_config=kernels)
  set_fusion(layer, fusion)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  kx, kc = jax.random.split(jax.random.PRNGKey(1))
  shape = (s["batch"], t, s["width"])
  x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
  ct = jax.random.normal(kc, shape, jnp.float32).astype(dtype)

  def apply(params, x):
    return nnx.merge(graphdef, params, rest)(x)[0]

  def loss(params, x, ct):
    return jnp.sum(apply(params, x).astype(jnp.float32) * ct.astype(jnp.float32))

  return jax.jit(apply), jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x), ct


def _jax_times(mixer, impl, t, s, fusion="on", kernels=None):
  """(fwd ms, fwd+bwd ms) of one kdn_jax layer, params passed to a pure jitted function."""
  fwd, fwd_bwd, args, ct = layer_fns(mixer, impl, t, s, fusion, kernels=kernels)
  timed = lambda fn, *a: median_time(fn, *args, *a, warmup=1 + s["warmup"], repeats=s["reps"])
  return timed(fwd), timed(fwd_bwd, ct)


def _fla_times(t, s, mods):
  """(fwd ms, fwd+bwd ms) of fla's KimiDeltaAttention layer (fp32 params, bf16 autocast)."""
  torch, fla_layers = mods
  torch.manual_seed(0)
  layer = fla_layers.KimiDeltaAttention(
    hidden_size=s["width"], num_heads=s["num_heads"], head_dim=s["head_dim"], mode="chunk"
  ).cuda()
  shape = (s["batch"], t, s["width"])
  x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
  ct = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
  leaves = [x.requires_grad_(True)] + list(layer.parameters())

  def fwd():
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
      layer(x)

  def fwd_bwd():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      y = layer(x)[0]
    torch.autograd.grad(y, leaves, ct)

  timed = lambda fn: torch_cuda_median_ms(fn, warmup=1 + s["warmup"], repeats=s["reps"])
  times = timed(fwd), timed(fwd_bwd)
  del layer, x, ct, leaves
  torch.cuda.empty_cache()  # hand the cached blocks back before XLA allocates
  return times


# ----------------------------------------------------------------------------------- report


def _fmt(v, spec=".2f"):
  return "" if v is None else format(v, spec)


def _fla_ms(results, t, key):
  m = [r for r in results["rows"] if r["row"] == FLA_ROW and r["T"] == t and r.get(key)]
  return m[0][key] if m else None


def _ratio(results, rec, key):
  ref = _fla_ms(results, rec["T"], key)
  return rec[key] / ref if rec.get(key) and ref else None


def verdicts(results):
  """One line per (target, impl) from the measured ratios to fla_kda_layer."""
  lines = []
  for mixer, key, bound in TARGETS:
    mode = {"fwd_bwd_ms": "fwd+bwd", "fwd_ms": "fwd"}[key]
    rows = sorted({r["row"] for r in results["rows"] if r["row"].startswith(mixer + "_")})
    for row in rows or [mixer]:
      cells = [(r["T"], _ratio(results, r, key)) for r in results["rows"] if r["row"] == row]
      cells = [(t, x) for t, x in cells if x is not None]
      if not cells:
        verdict = f"not measured (no {row} and {FLA_ROW} {mode} pair)"
      else:
        met = all(x <= bound for _, x in cells)
        verdict = ", ".join(f"T={t} {x:.2f}x" for t, x in cells) + (
          " -> MET" if met else " -> MISSED"
        )
      lines.append(f"target {row} {mode} <= {bound}x {FLA_ROW}: {verdict}")
  return lines


def report(results):
  s = results["settings"]
  rows = []
  for r in sorted(results["rows"], key=lambda r: r["T"]):
    if "fwd_ms" in r:
      cells = [
        _fmt(r["fwd_ms"]),
        _fmt(r["fwd_bwd_ms"]),
        _fmt(_ratio(results, r, "fwd_ms")),
        _fmt(_ratio(results, r, "fwd_bwd_ms")),
      ]
    else:
      why = r.get("skipped") or "error: " + r.get("error", "")
      cells = [why[:80].replace("|", "/"), "", "", ""]
    rows.append([r["row"], r["T"]] + cells)
  table = markdown_table(["row", "T", "fwd ms", "fwd+bwd ms", "fwd / fla", "fwd+bwd / fla"], rows)
  anchor_rows = [
    [name, t, f, fb, f"{fb / ANCHORS['fla KDA layer'][t][1]:.2f}"]
    for name, by_t in ANCHORS.items()
    for t, (f, fb) in by_t.items()
  ]
  anchors = markdown_table(
    ["layer (issue, not measured here)", "T", "fwd ms", "fwd+bwd ms", "fwd+bwd / fla"], anchor_rows
  )
  return (
    "\n".join(
      [
        "# Whole-layer timings (experiments/benchmarks/layers.py)\n",
        f"batch {s['batch']}, width {s['width']} = {s['num_heads']} heads x {s['head_dim']}, bf16 "
        f"compute, fp32 params, chunk {s['chunk_size']}; median of {s['reps']} runs after "
        f"{s['warmup']} warm-up; device {results['device']}, jax {results['jax']}. Ratios are to "
        f"the measured {FLA_ROW} at the same T.\n",
        table,
        "",
        "Reference numbers quoted in the issue (their GPU, PyTorch):\n",
        anchors,
        "",
        *(f"- {v}" for v in results["verdicts"]),
      ]
    )
    + "\n"
  )


def _plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(12, 5))
  for ax, key, col in zip(axes, ("fwd_ms", "fwd_bwd_ms"), (0, 1)):
    for row in dict.fromkeys(r["row"] for r in results["rows"]):
      pts = sorted((r["T"], r[key]) for r in results["rows"] if r["row"] == row and r.get(key))
      if pts:
        ax.plot(*zip(*pts), marker="o", label=row)
    paper = all(results["settings"][k] == v for k, v in PAPER_SHAPE.items())
    for name, by_t in ANCHORS.items() if paper else ():
      ts = sorted(by_t)
      ax.plot(ts, [by_t[t][col] for t in ts], ls=":", marker="x", label=f"{name} (issue)")
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms", title=key[:-3].replace("_", "+"))
    if ax.lines:
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _write(results, out):
  results["verdicts"] = verdicts(results)
  with open(out + ".json", "w") as fh:
    json.dump(results, fh, indent=1)
  md = report(results)
  with open(out + ".md", "w") as fh:
    fh.write(md)
  try:
    _plot(results, out + ".png")
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("plot failed: %s", e)
  return md


# ------------------------------------------------------------------------------------- main


def run(
  out,
  seq_lens=(4096, 16384),
  rows=JAX_MIXERS + (FLA_ROW,),
  impls=("chunked",),
  batch=4,
  width=2048,
  num_heads=16,
  head_dim=128,
  chunk_size=64,
  reps=30,
  warmup=3,
  time_budget_s=420.0,
  fusion=("on",),
  kernels=None,
):
  """Times every (row, T) cell until the budget runs out; writes and returns the results dict.
  kernels: the layers' pallas_kernels.KernelConfigs (None: the tuned configs)."""
  bad = [f for f in fusion if f not in ("on", "off") + FUSED_PIECES]
  if bad:
    raise ValueError(f"--fusion: unknown {bad}; expected on, off or one of {FUSED_PIECES}")
  unknown = [r for r in rows if r != FLA_ROW and r not in MIXERS]
  if unknown:
    raise ValueError(f"--rows: unknown {unknown}; expected {FLA_ROW} or one of {sorted(MIXERS)}")
  settings = dict(
    batch=batch,
    width=width,
    num_heads=num_heads,
    head_dim=head_dim,
    chunk_size=chunk_size,
    reps=reps,
    warmup=warmup,
  )
  results = {
    "device": str(jax.devices()[0]),
    "jax": jax.__version__,
    "settings": settings,
    **kernel_config.describe(kernels),
    "rows": [],
    "not_started": [],
  }
  fla, reason = None, None
  if FLA_ROW in rows:
    fla, reason = import_for_cuda("fla.layers")
    if fla is None:
      logging.warning("%s skipped: %s", FLA_ROW, reason)
  # Order: T by T; at each T our rows (impl by impl), then fla's layer. fla's first call autotunes
  # its Triton kernels (it did not finish within 90 s on an H200), so it must not come first.
  lens = [int(z) for z in seq_lens]
  cells = []
  for t in lens:
    cells += [
      (m, impl, t, f)
      for impl in impls
      for f in (fusion if impl == "pallas" else ("on",))
      for m in rows
      if m != FLA_ROW
    ]
    cells += [(FLA_ROW, None, t, "on")] if FLA_ROW in rows else []
  start = time.time()
  for mixer, impl, t, fused in cells:
    row = mixer if impl is None else f"{mixer}_{impl}"
    row += {"on": "", "off": "_unfused"}.get(fused, "_" + fused)
    rec = {"row": row, "T": t}
    if mixer == FLA_ROW and fla is None:
      rec["skipped"] = reason
    elif time.time() - start > time_budget_s:
      results["not_started"].append(rec)
      continue
    else:
      print(f"[{time.time() - start:7.1f}s] {row} T={t}: started", flush=True)
      try:
        ms = (
          _fla_times(t, settings, fla)
          if impl is None
          else _jax_times(mixer, impl, t, settings, fused, kernels)
        )
        rec["fwd_ms"], rec["fwd_bwd_ms"] = ms
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        logging.warning("%s T=%d failed: %s", row, t, traceback.format_exc()[-1500:])
    results["rows"].append(rec)
    print(
      f"[{time.time() - start:7.1f}s] {row} T={t}: "
      + (
        f"fwd {rec['fwd_ms']:.3f} ms, fwd+bwd {rec['fwd_bwd_ms']:.3f} ms"
        if "fwd_ms" in rec
        else rec.get("skipped") or rec.get("error")
      ),
      flush=True,
    )
    _write(results, out)
  if results["not_started"]:
    print(
      f"time budget {time_budget_s:.0f}s spent; not started: "
      + ", ".join(f"{r['row']}@{r['T']}" for r in results["not_started"]),
      flush=True,
    )
  print(_write(results, out), flush=True)
  return results


def main(argv):
  del argv
  kernels = kernel_config.from_flags(FLAGS)
  run(
    FLAGS.out,
    seq_lens=[int(t) for t in FLAGS.seq_lens],
    rows=tuple(FLAGS.rows),
    impls=tuple(FLAGS.impls),
    batch=FLAGS.batch,
    width=FLAGS.width,
    num_heads=FLAGS.num_heads,
    head_dim=FLAGS.head_dim,
    chunk_size=FLAGS.chunk_size,
    reps=FLAGS.reps,
    warmup=FLAGS.warmup,
    time_budget_s=FLAGS.time_budget_s,
    fusion=tuple(FLAGS.fusion),
    kernels=kernels,
  )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
