"""Context parallelism (kdn_jax.ops.context_parallel) timings: diag KDN fwd+bwd.

    python -m experiments.benchmarks.context_parallel            # GPU: the defaults below
    python -m experiments.benchmarks.context_parallel --tiny     # CPU: tiny shapes, checks it runs

Sections (one JSON + one markdown table in --out):
  overhead  plain `ops.diag_kdn` against the context-parallel op on a 1-device axis (context=1: the
            same work plus the slice transition, i.e. the augmented [V | K]-column memory run, the
            slice's Moebius product and the cross-slice chain), at --overhead_lens.
  long      a --long_len-token sequence (default 1M) at B=1: plain and context=1, time and memory.
  split     the same sequence split over n devices for n in --contexts (n > 1, n <= devices).

Memory: `compiled.memory_analysis()` of each fwd+bwd program (arguments + outputs + temporaries, per
device) and, where the backend reports it, the device's peak_bytes_in_use after the row (a running
maximum over the process, so rows are ordered smallest first). A row that fails (e.g. out of memory)
records its error and the script goes on.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.benchmarks import timing
from experiments.runner import cli
from kdn_jax import ops

FLAGS = flags.FlagValues()
flags.DEFINE_string("out", "/tmp/benchmark_context_parallel", "output directory", flag_values=FLAGS)
flags.DEFINE_boolean(
  "tiny", False, "tiny CPU shapes (B=1, H=2, K=V=16, T=64; float32, chunked)", flag_values=FLAGS
)
flags.DEFINE_list(
  "overhead_lens", ["4096", "16384", "65536"], "lengths of the overhead rows", flag_values=FLAGS
)
flags.DEFINE_integer("long_len", 1 << 20, "length of the long and split rows", flag_values=FLAGS)
flags.DEFINE_list(
  "contexts",
  [],
  "axis sizes of the split rows (default: 2, 4, ... up to the device count)",
  flag_values=FLAGS,
)
flags.DEFINE_integer("batch", 1, "batch size", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "heads", flag_values=FLAGS)
flags.DEFINE_integer("dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_string("dtype", "bfloat16", "input dtype", flag_values=FLAGS)
flags.DEFINE_string("impl", "auto", "local impl (auto: pallas on GPU)", flag_values=FLAGS)
flags.DEFINE_integer("reps", 5, "timed runs (median reported)", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 1, "untimed runs after compilation", flag_values=FLAGS)

_NAMES = ("q", "k", "v", "log_alpha", "omega", "r")


def _make_inputs(batch, t, heads, dim, dtype, sharding):
  """Layer-like random inputs, made on the devices (sharded along T when asked)."""

  def make(key):
    ks = jax.random.split(key, 6)
    shape = (batch, t, heads, dim)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], shape))
    k = unit(jax.random.normal(ks[1], shape))
    v = jax.random.normal(ks[2], shape)
    log_alpha = -jax.nn.softplus(jax.random.normal(ks[3], shape) - 3.0)
    omega = 0.1 * jax.nn.softplus(jax.random.normal(ks[4], shape))
    r = 0.01 + jax.nn.softplus(jax.random.normal(ks[5], (batch, t, heads)))
    return tuple(x.astype(dtype) for x in (q, k, v, log_alpha, omega, r))

  shardings = None if sharding is None else (sharding,) * 6
  return jax.jit(make, out_shardings=shardings)(jax.random.key(0))


def _fwd_bwd(fn, impl):
  """jit of the gradient of sum(o) w.r.t. all six inputs (o and the grads are the outputs)."""

  def loss(*args):
    o, _ = fn(*args, impl=impl)
    return jnp.sum(o.astype(jnp.float32)), o

  return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))


def _peak_bytes(device):
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("peak_bytes_in_use")


def _row(section, t, contexts, fn, impl, args, reps, warmup):
  row = {"section": section, "T": t, "context": contexts}
  try:
    compiled = _fwd_bwd(fn, impl).lower(*args).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
      row["program_bytes"] = int(
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
      )
    row["ms"] = timing.median_time(compiled, *args, warmup=warmup, repeats=reps)
    row["ms_per_mtoken"] = row["ms"] * 1e6 / (t * args[0].shape[0])
  except Exception as e:  # pylint: disable=broad-except  (an OOM row is a result too)
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  row["device_peak_bytes"] = _peak_bytes(jax.devices()[0])
  print(json.dumps(row), flush=True)
  return row


def _settings():
  s = dict(
    batch=FLAGS.batch,
    heads=FLAGS.heads,
    dim=FLAGS.dim,
    dtype=FLAGS.dtype,
    impl=FLAGS.impl,
    overhead_lens=[int(x) for x in FLAGS.overhead_lens],
    long_len=FLAGS.long_len,
    reps=FLAGS.reps,
    warmup=FLAGS.warmup,
  )
  if FLAGS.tiny:
    s.update(
      batch=1,
      heads=2,
      dim=16,
      dtype="float32",
      impl="chunked",
      overhead_lens=[64],
      long_len=64,
      reps=1,
      warmup=1,
    )
  n_dev = len(jax.devices())
  if FLAGS.contexts:
    s["contexts"] = [int(x) for x in FLAGS.contexts]
  else:
    s["contexts"] = [n for n in (2, 4, 8, 16) if n <= n_dev]
  bad = [n for n in s["contexts"] if n < 2 or n > n_dev or s["long_len"] % n]
  if bad:
    raise ValueError(
      f"--contexts: {bad} must be in [2, {n_dev}] (the devices) and divide "
      f"--long_len={s['long_len']}"
    )
  return s


def run(s):
  """All rows for settings s; returns them (also written to --out)."""
  dtype = jnp.dtype(s["dtype"])
  one = Mesh(np.array(jax.devices()[:1]), ("context",))
  cp_one = ops.context_sharded("diag_kdn", one)
  rows = []
  lens = sorted(set(s["overhead_lens"]))
  for t in lens:
    args = _make_inputs(s["batch"], t, s["heads"], s["dim"], dtype, None)
    section = "overhead+long" if t == s["long_len"] else "overhead"
    rows.append(_row(section, t, 0, ops.diag_kdn, s["impl"], args, s["reps"], s["warmup"]))
    rows.append(_row(section, t, 1, cp_one, s["impl"], args, s["reps"], s["warmup"]))
    del args
  if s["long_len"] not in lens:
    args = _make_inputs(s["batch"], s["long_len"], s["heads"], s["dim"], dtype, None)
    rows.append(
      _row("long", s["long_len"], 0, ops.diag_kdn, s["impl"], args, s["reps"], s["warmup"])
    )
    rows.append(_row("long", s["long_len"], 1, cp_one, s["impl"], args, s["reps"], s["warmup"]))
    del args
  for n in s["contexts"]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    args = _make_inputs(
      s["batch"],
      s["long_len"],
      s["heads"],
      s["dim"],
      dtype,
      NamedSharding(mesh, P(None, "context")),
    )
    rows.append(
      _row(
        "split",
        s["long_len"],
        n,
        ops.context_sharded("diag_kdn", mesh),
        s["impl"],
        args,
        s["reps"],
        s["warmup"],
      )
    )
    del args
  for row in rows:  # plain = context 0; the overhead is relative to the plain row at that T
    plain = next((r for r in rows if r["T"] == row["T"] and r["context"] == 0 and "ms" in r), None)
    if plain and "ms" in row and row["context"] > 0:
      row["x_plain"] = row["ms"] / plain["ms"]
  return rows


def _table(rows):
  fmt = lambda x, f: "" if x is None else f.format(x)
  gib = lambda b: None if b is None else b / 2**30
  body = [
    [
      r["section"],
      r["T"],
      "plain" if r["context"] == 0 else r["context"],
      fmt(r.get("ms"), "{:.2f}"),
      fmt(r.get("x_plain"), "{:.2f}"),
      fmt(gib(r.get("program_bytes")), "{:.2f}"),
      fmt(gib(r.get("device_peak_bytes")), "{:.2f}"),
      r.get("error", ""),
    ]
    for r in rows
  ]
  return timing.markdown_table(
    [
      "section",
      "T",
      "context",
      "fwd+bwd ms",
      "x plain",
      "program GiB/device",
      "device peak GiB",
      "error",
    ],
    body,
  )


def main(argv):
  del argv
  s = _settings()
  start = time.time()
  rows = run(s)
  os.makedirs(FLAGS.out, exist_ok=True)
  result = {
    "settings": s,
    "device": jax.devices()[0].device_kind,
    "num_devices": len(jax.devices()),
    "rows": rows,
    "wall_s": time.time() - start,
  }
  with open(os.path.join(FLAGS.out, "benchmark_context_parallel.json"), "w") as f:
    json.dump(result, f, indent=1)
  table = _table(rows)
  with open(os.path.join(FLAGS.out, "benchmark_context_parallel.md"), "w") as f:
    f.write(
      f"diag KDN fwd+bwd, B={s['batch']} H={s['heads']} K=V={s['dim']} {s['dtype']}, "
      f"impl={s['impl']}, {result['device']} x{result['num_devices']}\n\n{table}\n"
    )
  print(table)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
