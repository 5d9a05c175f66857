"""How the mixers benchmark times: a row (JAX or fla's PyTorch), and the diag-KDN Pallas path stage
by stage (the delta rule's stages as the op runs them, each jitted alone)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from experiments.benchmarks.mixers import arg_specs
from experiments.benchmarks.timing import median_time, torch_cuda_median_ms


@dataclasses.dataclass(frozen=True)
class Timing:
  """A cell's time: the median of ``reps`` runs after one compiling call and ``warmup`` untimed
  runs, on inputs of ``shape``."""

  shape: arg_specs.Shape = arg_specs.Shape()
  reps: int = 30
  warmup: int = 3


def time_fn(fn, args, timing: Timing, compile_times=None, name=None):
  """Median ms of ``fn(*args)``; with ``compile_times`` (a dict), the first call's wall time
  (compilation included) is stored there under ``name``."""
  if compile_times is not None:
    t0 = time.time()
    jax.block_until_ready(fn(*args))
    compile_times[name] = round(time.time() - t0, 2)
  return median_time(fn, *args, warmup=1 + timing.warmup, repeats=timing.reps)


def time_jax_row(row, t, fwd_bwd, timing: Timing, compile_times=None, kernels=None):
  fn, args = arg_specs.jax_row_fn(row, t, fwd_bwd, kernels, timing.shape)
  return time_fn(fn, args, timing, compile_times, row)


def time_fla_row(row, t, fwd_bwd, timing: Timing):
  torch, run = arg_specs.fla_row_fn(row, t, fwd_bwd, timing.shape)
  with torch.set_grad_enabled(fwd_bwd):
    return torch_cuda_median_ms(run, warmup=1 + timing.warmup, repeats=timing.reps)


class _StageTimer:
  """A delta-rule stage runner (pallas_kernels/delta_rule/stages.py) that times each stage the
  op runs, jitted alone with the op's own arguments, into out[prefix + stage name], and hands
  the stage's results on to the next."""

  def __init__(self, prefix, out, first, timing):
    self.prefix, self.out, self.first, self.timing = prefix, out, first, timing

  def __call__(self, name, fn, *arrays, **static):
    key = self.prefix + name
    # (arrays as arguments: closed-over arrays become constants that XLA folds for minutes)
    stage = jax.jit(functools.partial(fn, **static))
    self.out[key] = time_fn(stage, arrays, self.timing, self.first, key)
    return stage(*arrays)


def time_stages(t, timing: Timing, docs=False, kernels=None):
  """Per-stage times (ms) of the diag-KDN Pallas path at length t: the gain ("gain_fwd"), then
  the delta rule's stages as the op runs them (its forward_stages / backward_stages, each stage
  jitted alone): "fwd/<stage>" for a differentiated call's forward (which saves the
  residuals), "fwd_only/<stage>" for a call not differentiated, "bwd/<stage>", and each
  group's "<group>/sum". docs: packed documents of arg_specs.DOC_LEN tokens (segment_ids);
  kernels: the configs (None: the tuned ones)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import (  # pylint: disable=g-import-not-at-top
    backward_stages,
    forward_stages,
    stage_inputs,
  )

  b, h, d = timing.shape.batch, timing.shape.heads, timing.shape.dim
  x = arg_specs.inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16)
  kernels = arg_specs.kernels_or_tuned(kernels)
  seg = arg_specs.doc_ids(b, t) if docs else None
  out, first = {}, {}
  mu = jnp.full((h,), float(d), jnp.float32)
  p0 = jnp.ones((b, h, d), jnp.float32)
  # (kappa stored as the op stores it: pallas_kernels.write_dtype)
  gain = jax.jit(
    lambda k, la, om, r, seg: pk.diag_gain(
      k, la, om, r, mu, p0, seg, gain_dtype=pk.write_dtype(k.dtype), config=kernels.gain
    )[0]
  )
  gargs = (x["k"], x["la"], x["om"], x["r"], seg)
  out["gain_fwd"] = time_fn(gain, gargs, timing, first, "gain_fwd")
  h0 = jnp.zeros((b, h, d, d), jnp.float32)
  args, static = stage_inputs(
    x["q"], x["k"], x["v"], x["la"], gain(*gargs), d**-0.5, h0, seg, config=kernels.delta_rule
  )
  timer = lambda prefix: _StageTimer(prefix, out, first, timing)
  saved = forward_stages(*args, **static, save=True, run=timer("fwd/"))
  forward_stages(*args, **static, save=False, run=timer("fwd_only/"))
  q, k, v, w, _, h0, starts, cont, pid = args
  (o, sfin, g), residuals = saved[:3], saved[3:]
  cts = (jnp.ones_like(o), jnp.zeros_like(sfin))
  backward_stages(
    *(q, k, v, w, g, h0, starts, cont, pid), *residuals, *cts, **static, run=timer("bwd/")
  )
  for group in ("fwd/", "fwd_only/", "bwd/"):
    out[group + "sum"] = sum(ms for name, ms in list(out.items()) if name.startswith(group))
  out["first_call_s"] = first
  return out
