"""Timing helpers shared by the benchmark scripts (JAX, and PyTorch on CUDA for the fla rows)."""

import importlib
import statistics
import time

import jax


def median_time(fn, *args, warmup=2, repeats=10):
  """Median wall time in ms of jitted `fn(*args)` after warm-up (compile)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def import_for_cuda(*names):
  """Imports torch and the modules `names` (e.g. 'fla.ops.kda') for timing on a CUDA GPU.

  Returns ([torch, *modules], None), or (None, reason) when an import fails or torch sees no
  CUDA device."""
  try:
    mods = [importlib.import_module(n) for n in ("torch",) + names]
  except Exception as e:  # pylint: disable=broad-except
    return None, f"import failed: {type(e).__name__}: {e}"
  if not mods[0].cuda.is_available():
    return None, "torch sees no CUDA device"
  return mods, None


def torch_cuda_median_ms(run, warmup=2, repeats=10):
  """Median time in ms of `run()` on the current CUDA stream (torch.cuda events)."""
  import torch  # pylint: disable=g-import-not-at-top

  for _ in range(warmup):
    run()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times)


def markdown_table(header, rows):
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)
