"""Timing helpers shared by the benchmark scripts."""

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


def markdown_table(header, rows):
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)
