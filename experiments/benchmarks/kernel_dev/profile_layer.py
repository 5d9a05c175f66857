r"""Where a whole mixer layer's fwd+bwd time goes: device time per kernel and per bucket.

Builds one layer as experiments/benchmarks/layers.py times it (its `layer_fns`: the registry's
mixer, gradients of sum(y * ct) w.r.t. the input and all params), records a
`jax.profiler.trace` of --iters fwd+bwd calls and sums the kernels of the GPU streams in the
trace's perfetto_trace.json.gz. On CPU there are no GPU streams: the host's XLA op events are
summed instead (their exclusive time; CPU threads run in parallel, so that total can exceed wall).

GPU (device tool):
  python3 -m experiments.benchmarks.kernel_dev.profile_layer --seq_len=16384 --out=$OUT/profile_16k.json
CPU check:
  python -m experiments.benchmarks.kernel_dev.profile_layer --seq_len=64 --batch=1 --heads=2 --head_dim=64 \
      --chunk_size=16 --impl=chunked
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax
from absl import app, flags

from experiments.benchmarks.layers import FUSED_PIECES, layer_fns
from experiments.benchmarks.timing import markdown_table, median_time
from experiments.runner import cli

FLAGS = flags.FlagValues()
flags.DEFINE_string("mixer", "kdn_diag", "registry mixer name", flag_values=FLAGS)
flags.DEFINE_string(
  "impl", "auto", "memory-update impl; auto = pallas on GPU, chunked elsewhere", flag_values=FLAGS
)
flags.DEFINE_enum(
  "fusion",
  "on",
  ("on", "off") + FUSED_PIECES,
  "benchmarks/layers.py set_fusion: the fused glue kernels (pallas path)",
  flag_values=FLAGS,
)
flags.DEFINE_integer("seq_len", 16384, "T", flag_values=FLAGS)
flags.DEFINE_integer("batch", 4, "B", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer("width", 0, "d_model; 0 = heads * head_dim", flag_values=FLAGS)
flags.DEFINE_integer("chunk_size", 64, "memory chunk length", flag_values=FLAGS)
flags.DEFINE_enum(
  "dtype", "bf16", ("bf16", "fp32"), "compute dtype (params stay fp32)", flag_values=FLAGS
)
flags.DEFINE_enum(
  "mode",
  "fwd_bwd",
  ("fwd_bwd", "fwd"),
  "what the trace records: fwd+bwd calls, or the forward alone",
  flag_values=FLAGS,
)
flags.DEFINE_integer("iters", 3, "calls inside the trace", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "untimed calls after the compiling one", flag_values=FLAGS)
flags.DEFINE_integer(
  "reps", 10, "timed calls for the wall time (median, no profiler)", flag_values=FLAGS
)
flags.DEFINE_integer("top", 25, "kernels listed", flag_values=FLAGS)
flags.DEFINE_string(
  "logdir", "", "trace directory; empty = a fresh temporary one", flag_values=FLAGS
)
flags.DEFINE_string("out", "/tmp/profile_layer.json", "JSON with everything", flag_values=FLAGS)

# First match wins. Our pallas_call names (grep pallas_kernels/ for `name=`) come first; copies,
# reductions and casts before the generic fusion bucket (loop_transpose_fusion is a copy,
# wrapped_convert_3 a cast). XLA's Triton GEMMs are gemm_fusion_dot_*, cuBLAS's sm90_xmma_* / nvjet_*.
BUCKETS = (
  ("delta_rule (pallas)", r"delta_rule"),
  ("gain (pallas)", r"kdn_gain"),
  ("causal_conv (pallas)", r"causal_conv"),
  ("gated_norm (pallas)", r"gated_norm"),
  ("gemm (cuBLAS/cutlass)", r"gemm|cutlass|cublas|nvjet|xmma|sm90|sm80|(^|[_.])dot"),
  ("copy/transpose", r"copy|transpose|memcpy|memset"),
  ("reduction", r"reduce"),
  ("convert (casts)", r"convert"),
  ("xla fusion", r"fusion|^loop_|^input_|^wrapped_"),
)
OTHER = "other"
# Lines of a GPU plane that re-list the stream kernels per HLO op / module / step.
DERIVED_LINES = (
  "xla ops",
  "xla modules",
  "async xla ops",
  "steps",
  "tensorflow ops",
  "tensorflow name scope",
  "framework ops",
  "framework name scope",
  "launch stats",
  "source code",
  "cupti overhead",
)


def bucket(name):
  for label, pattern in BUCKETS:
    if re.search(pattern, name, re.IGNORECASE):
      return label
  return OTHER


def find_trace(logdir):
  paths = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {logdir}")
  return max(paths, key=os.path.getmtime)


def _is_device_thread(process, thread):
  """A GPU stream ("Stream #7(Kernel,MemcpyD2D)" on xprof's planes), or any non-derived line of
  a /device:GPU process (in case a version names its stream lines otherwise); never a host
  thread, whatever its name."""
  t, p = thread.lower(), process.lower()
  if t in DERIVED_LINES or p.startswith("/host"):
    return False
  return "stream" in t or "/device:gpu" in p


def _self_times(events):
  """Exclusive time of each event of one thread (a parent minus its nested children): CPU XLA
  ops nest (a while around its body's ops); GPU kernels on one stream do not, so dur stays."""
  events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
  self_t = [e["dur"] for e in events]
  stack = []  # indices of open events
  for i, e in enumerate(events):
    while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
      stack.pop()
    if stack:
      p = events[stack[-1]]
      self_t[stack[-1]] -= min(e["dur"], p["ts"] + p["dur"] - e["ts"])
    stack.append(i)
  return list(zip(events, self_t))


def _busy(intervals):
  """Length of the union of (start, end) intervals."""
  total, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def parse_trace(path, iters):
  """Device (or, without GPU streams, host XLA op) time per kernel name, in ms per iteration."""
  with gzip.open(path, "rt") as fh:
    trace = json.load(fh)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      by_thread[(e["pid"], e.get("tid"))].append(e)
  label = lambda key: (procs.get(key[0], str(key[0])), threads.get(key, str(key[1])))
  device = [k for k in by_thread if _is_device_thread(*label(k))]
  if device:
    mode, keep = "gpu streams", lambda e: True
  else:
    # CPU: the thunk executor tags each XLA op event with its HLO op; other events are runtime.
    mode, device = "host XLA ops (no GPU streams in the trace)", list(by_thread)
    keep = lambda e: "hlo_op" in (e.get("args") or {})
  per_kernel = collections.defaultdict(lambda: {"us": 0.0, "calls": 0, "hlo_ops": set()})
  thread_rows, spans = [], []
  for key in device:
    kept = [(e, t) for e, t in _self_times(by_thread[key]) if keep(e)]
    if not kept:
      continue
    for e, t in kept:
      k = per_kernel[e["name"]]
      k["us"] += t
      k["calls"] += 1
      k["hlo_ops"].add((e.get("args") or {}).get("hlo_op", ""))
      spans.append((e["ts"], e["ts"] + e["dur"]))
    thread_rows.append(
      {
        "process": label(key)[0],
        "thread": label(key)[1],
        "events": len(kept),
        "ms_per_iter": sum(t for _, t in kept) / 1e3 / iters,
      }
    )
  kernels = sorted(
    (
      {
        "name": n,
        "bucket": bucket(n),
        "ms": v["us"] / 1e3 / iters,
        "calls_per_iter": v["calls"] / iters,
        "hlo_ops": sorted(h for h in v["hlo_ops"] if h)[:5],
      }
      for n, v in per_kernel.items()
    ),
    key=lambda k: -k["ms"],
  )
  total = sum(k["ms"] for k in kernels)
  buckets = collections.defaultdict(lambda: {"ms": 0.0, "kernels": 0})
  for k in kernels:
    buckets[k["bucket"]]["ms"] += k["ms"]
    buckets[k["bucket"]]["kernels"] += 1
  for b in buckets.values():
    b["share"] = b["ms"] / total if total else 0.0
  return {
    "mode": mode,
    "trace": path,
    "total_device_ms": total,
    "busy_ms": _busy(spans) / 1e3 / iters,  # union over streams/threads: idle gaps show
    "buckets": dict(sorted(buckets.items(), key=lambda kv: -kv[1]["ms"])),
    "kernels": kernels,
    "threads": thread_rows,
    "all_threads": sorted({" / ".join(label(k)) for k in by_thread}),
  }


def report(res, top):
  p = res["profile"]
  per = "fwd" if res["settings"].get("mode") == "fwd" else "fwd+bwd"
  rows = [
    [name, f"{b['ms']:.3f}", f"{100 * b['share']:.1f}%", b["kernels"]]
    for name, b in p["buckets"].items()
  ]
  krows = [
    [k["name"][:90], k["bucket"], f"{k['ms']:.3f}", f"{k['calls_per_iter']:g}"]
    for k in p["kernels"][:top]
  ]
  return "\n".join(
    [
      f"{res['settings']['mixer']} impl={res['settings']['impl']} on {res['device']}, "
      f"jax {res['jax']}: summed {p['mode']}",
      f"per {per}: kernels {p['total_device_ms']:.3f} ms, busy (union) {p['busy_ms']:.3f} ms, "
      f"wall without profiler {res['wall_ms_fwd_bwd']:.3f} ms (fwd alone {res['wall_ms_fwd']:.3f})",
      "",
      markdown_table(["bucket", f"ms / {per}", "share", "kernels"], rows),
      "",
      f"top {top} kernels:",
      markdown_table(["kernel", "bucket", f"ms / {per}", "calls"], krows),
    ]
  )


def main(argv):
  del argv
  impl = FLAGS.impl
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "chunked"
  s = dict(
    batch=FLAGS.batch,
    width=FLAGS.width or FLAGS.heads * FLAGS.head_dim,
    num_heads=FLAGS.heads,
    head_dim=FLAGS.head_dim,
    chunk_size=FLAGS.chunk_size,
  )
  dtype = {"bf16": "bfloat16", "fp32": "float32"}[FLAGS.dtype]
  fwd, fwd_bwd, args, ct = layer_fns(FLAGS.mixer, impl, FLAGS.seq_len, s, FLAGS.fusion, dtype)
  wall_fwd = median_time(fwd, *args, warmup=1 + FLAGS.warmup, repeats=FLAGS.reps)
  wall = median_time(fwd_bwd, *args, ct, warmup=1 + FLAGS.warmup, repeats=FLAGS.reps)
  logdir = FLAGS.logdir or tempfile.mkdtemp(prefix="profile_layer_")
  traced = (lambda: fwd(*args)) if FLAGS.mode == "fwd" else (lambda: fwd_bwd(*args, ct))
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(FLAGS.iters):
      jax.block_until_ready(traced())
  res = {
    "device": str(jax.devices()[0]),
    "jax": jax.__version__,
    "settings": dict(
      s,
      mixer=FLAGS.mixer,
      impl=impl,
      fusion=FLAGS.fusion,
      T=FLAGS.seq_len,
      mode=FLAGS.mode,
      dtype=dtype,
      iters=FLAGS.iters,
      reps=FLAGS.reps,
    ),
    "wall_ms_fwd_bwd": wall,
    "wall_ms_fwd": wall_fwd,
    "profile": parse_trace(find_trace(logdir), FLAGS.iters),
  }
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as fh:
    json.dump(res, fh, indent=1)
  print(report(res, FLAGS.top))
  print(f"\nwrote {FLAGS.out} (trace {res['profile']['trace']})")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
