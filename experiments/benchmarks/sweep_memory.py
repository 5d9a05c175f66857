"""Memory per member of a vmapped learning-rate x seed sweep (experiments/runner/lr_sweep.py).

    python -m experiments.benchmarks.sweep_memory --widths=64,128 --mixers=kdn_diag,kda   # compiled
    python -m experiments.benchmarks.sweep_memory --widths=64 --mixers=kdn_diag --run_step # + one step

level 'step' (default): the MQAR Zoology sweep's train step (configs/mqar_zoology.py: 2 layers,
vocabulary 8192, T = 256, 4 rates x 3 seeds) at --batch, compiled; bytes from
`memory_analysis()` (temporaries + arguments + outputs - donated aliases), per member. With
--run_step one step also runs and the device's peak_bytes_in_use is reported (a process-wide
running maximum: run one (width, mixer) per process for a clean number). level 'op': the
recurrence alone (diag_kdn / iso_kdn / kda / gated_delta_rule), fwd+bwd vmapped over --members,
[B, T, H, K] = [--batch, --seq_len, 2, width / 2]. One JSON line per row on stdout and in --out.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from configs import mqar_zoology as zoo
from experiments.runner import cli, lr_sweep, sharding
from kdn_jax import ops

FLAGS = flags.FlagValues()
flags.DEFINE_list("widths", ["64", "128"], "model widths (d)", flag_values=FLAGS)
flags.DEFINE_list(
  "mixers", ["kdn_diag", "kdn_iso", "kda", "gated_deltanet"], "mixers", flag_values=FLAGS
)
flags.DEFINE_enum("level", "step", ["step", "op"], "whole train step or the op", flag_values=FLAGS)
flags.DEFINE_integer("batch", 128, "batch per member", flag_values=FLAGS)
flags.DEFINE_string(
  "impl", "auto", "model.impl (auto: pallas on GPU, chunked on CPU)", flag_values=FLAGS
)
flags.DEFINE_boolean(
  "run_step", False, "also run one step and read the device peak", flag_values=FLAGS
)
flags.DEFINE_integer("members", 12, "members (level op)", flag_values=FLAGS)
flags.DEFINE_integer("seq_len", 256, "T (level op)", flag_values=FLAGS)
flags.DEFINE_integer("chunk", 64, "chunk size (level op)", flag_values=FLAGS)
flags.DEFINE_string("out", "", "append the JSON lines to this file", flag_values=FLAGS)

OP_MIXERS = ("kdn_diag", "kdn_iso", "kda", "gated_deltanet")


def _bytes(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {
    "temp": m.temp_size_in_bytes,
    "argument": m.argument_size_in_bytes,
    "output": m.output_size_in_bytes,
    "alias": m.alias_size_in_bytes,
  }
  out["total"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
  return out


def op_memory(mixer, members, batch, seq_len, heads, dim, chunk, impl="chunked") -> dict:
  """Compiled memory of the recurrence's fwd+bwd vmapped over `members`, float32 inputs."""
  if mixer not in OP_MIXERS:
    raise ValueError(f"mixer: expected one of {OP_MIXERS}, got {mixer!r}")
  per_channel = (members, batch, seq_len, heads, dim)
  per_head = per_channel[:-1]
  shapes = dict(q=per_channel, k=per_channel, v=per_channel, g=per_channel)
  shapes.update(
    {
      "kdn_diag": dict(omega=per_channel, r=per_head),
      "kdn_iso": dict(omega=per_head, r=per_head),
    }.get(mixer, dict(beta=per_head))
  )
  if mixer == "gated_deltanet":
    shapes["g"] = per_head
  kw = dict(impl=impl, chunk_size=chunk)
  call = {
    "kdn_diag": lambda a: ops.diag_kdn(a["q"], a["k"], a["v"], a["g"], a["omega"], a["r"], **kw),
    "kdn_iso": lambda a: ops.iso_kdn(a["q"], a["k"], a["v"], a["g"], a["omega"], a["r"], **kw),
    "kda": lambda a: ops.kda(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw),
    "gated_deltanet": lambda a: ops.gated_delta_rule(
      a["q"], a["k"], a["v"], a["g"], a["beta"], **kw
    ),
  }[mixer]
  args = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()}
  grad = jax.vmap(jax.grad(lambda a: jnp.sum(call(a)[0] ** 2)))
  out = _bytes(jax.jit(grad).lower(args).compile())
  return dict(out, per_member=out["total"] / members, members=members)


def step_memory(width, mixer, batch, impl="auto", run_step=False) -> dict:
  """Compiled memory of the MQAR Zoology sweep's train step (and with run_step, the device peak
  after one step)."""
  c = zoo.get_config(f"d{width},{mixer}")
  with c.unlocked():
    c.model.impl = impl
    c.data.global_batch_size = c.data.eval_batch_size = c.data.num_eval_examples = batch
    c.checkpoint.enabled = False
  workdir = tempfile.mkdtemp(prefix="sweep_memory_")
  tr = lr_sweep.make_trainer(c, workdir)
  try:
    batch_arrays = tr._global_batch(next(tr.data_iter))  # pylint: disable=protected-access
    with sharding.context_parallel(tr.mesh):
      compiled = tr._train_step_jit.jitted.lower(tr.state, tr.rest, batch_arrays).compile()  # pylint: disable=protected-access
    out = _bytes(compiled)
    n = len(tr.members)
    out.update(per_member=out["total"] / n, members=n)
    if run_step:
      t0 = time.time()
      jax.block_until_ready(tr.train_step(next(tr.data_iter)))
      out["first_step_s"] = time.time() - t0  # (its compile included)
      stats = jax.local_devices()[0].memory_stats() or {}
      if "peak_bytes_in_use" in stats:
        out["peak_bytes_in_use"] = stats["peak_bytes_in_use"]
        out["peak_per_member"] = stats["peak_bytes_in_use"] / n
    return out
  finally:
    tr.close()
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  for w in FLAGS.widths:
    for mixer in FLAGS.mixers:
      row = dict(
        width=int(w),
        mixer=mixer,
        level=FLAGS.level,
        batch=FLAGS.batch,
        impl=FLAGS.impl,
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
      )
      if FLAGS.level == "op":
        row.update(
          op_memory(
            mixer,
            FLAGS.members,
            FLAGS.batch,
            FLAGS.seq_len,
            2,
            int(w) // 2,
            FLAGS.chunk,
            "chunked" if FLAGS.impl == "auto" and jax.default_backend() == "cpu" else FLAGS.impl,
          )
        )
      else:
        row.update(step_memory(int(w), mixer, FLAGS.batch, FLAGS.impl, FLAGS.run_step))
      line = json.dumps(row)
      print(line, flush=True)
      print(
        f"# d{w} {mixer}: {row['per_member'] / 2**20:.1f} MiB per member compiled"
        + (f", peak {row['peak_per_member'] / 2**20:.1f} MiB" if "peak_per_member" in row else ""),
        flush=True,
      )
      if FLAGS.out:
        with open(FLAGS.out, "a", encoding="utf-8") as f:
          f.write(line + "\n")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
