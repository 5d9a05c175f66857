"""One mixers-benchmark row run under Nsight Compute: the row is built and run once unprofiled
(compilation, fla's autotuning), then run --runs times between cudaProfilerStart / Stop, so that

  ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
      python3 -m experiments.benchmarks.kernel_dev.profile_kernels --row=diag_kdn_pallas --seq_len=4096 --mode=fwd

reports the kernels of those runs and nothing else (GPU; gpu_measurements.sh's `ncu` section
runs it on the pair kernels; docs/kernel_dev.md)."""

import time

import jax
from absl import app, flags

from experiments.benchmarks.mixers import arg_specs
from experiments.runner import cli

FLAGS = flags.FlagValues()
flags.DEFINE_string(
  "row", "diag_kdn_pallas", "a mixers-benchmark row (fla_* rows need fla)", flag_values=FLAGS
)
flags.DEFINE_integer("seq_len", 4096, "T", flag_values=FLAGS)
flags.DEFINE_enum("mode", "fwd", ["fwd", "fwd_bwd"], "what one run does", flag_values=FLAGS)
flags.DEFINE_integer("runs", 1, "profiled runs", flag_values=FLAGS)


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top  (cudaProfilerStart / Stop; GPU only)

  fwd_bwd = FLAGS.mode == "fwd_bwd"
  if FLAGS.row.startswith("fla_"):
    _, run = arg_specs.fla_row_fn(FLAGS.row, FLAGS.seq_len, fwd_bwd)
    torch.set_grad_enabled(fwd_bwd)
  else:
    fn, args = arg_specs.jax_row_fn(FLAGS.row, FLAGS.seq_len, fwd_bwd)
    run = lambda: jax.block_until_ready(fn(*args))
  run()  # compile / autotune, not profiled
  torch.cuda.synchronize()
  torch.cuda.cudart().cudaProfilerStart()
  t0 = time.time()
  for _ in range(FLAGS.runs):
    run()
  torch.cuda.synchronize()
  torch.cuda.cudart().cudaProfilerStop()
  print(
    f"{FLAGS.row} {FLAGS.mode} T={FLAGS.seq_len}: {FLAGS.runs} run(s) under the profiler in "
    f"{time.time() - t0:.1f} s"
  )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
