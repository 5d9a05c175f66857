"""Mixer-only timing: KDN (diag / iso), KDA and GDN in JAX, and fla's Triton kernels in PyTorch.

Usage:
  python -m experiments.benchmarks.mixers --out=/tmp/bench --seq_lens=2048,4096,8192
  python -m experiments.benchmarks.mixers --check_only   # GPU correctness check of the kernels

Batch 4, 16 heads of K = V = 128, bf16 inputs; median of --reps timed runs after --warmup runs,
forward and forward+backward. Writes results.md, results.json and results.png to --out (the
JSON and table after every sweep spec and cell, so a run cut off by its time limit keeps them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.benchmarks.timing import import_for_cuda, median_time, torch_cuda_median_ms
from experiments.kernel_config import config_from_spec
from experiments.runner import cli

# This script's flags live in their own registry: benchmarks/layers.py defines flags of the same names
# (--out, --seq_lens, ...) and a test process imports both modules.
FLAGS = flags.FlagValues()
flags.DEFINE_string("out", "/tmp/benchmark_mixers", "output directory", flag_values=FLAGS)
flags.DEFINE_list(
  "seq_lens", ["2048", "4096", "8192", "16384", "32768"], "sequence lengths", flag_values=FLAGS
)
flags.DEFINE_integer("batch", 4, "batch size", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "heads", flag_values=FLAGS)
flags.DEFINE_integer("dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer("reps", 30, "timed runs (median reported)", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 3, "untimed runs after compilation", flag_values=FLAGS)
flags.DEFINE_list(
  "rows",
  [
    "diag_kdn_pallas",
    "iso_kdn_pallas",
    "diag_gain_pallas",
    "iso_gain_pallas",
    "diag_kdn_chunked",
    "iso_kdn_chunked",
    "kda_pallas",
    "gdn_pallas",
    "kda_chunked",
    "gdn_chunked",
    "fla_chunk_kda",
    "fla_chunk_gdn",
  ],
  "rows to time; diag_kdn_seg_<impl> / iso_kdn_seg_<impl>: with segment_ids "
  "(packed documents of 1000 tokens)",
  flag_values=FLAGS,
)
flags.DEFINE_integer(
  "chunked_max_len", 32768, "skip *_chunked rows above this length", flag_values=FLAGS
)
flags.DEFINE_list(
  "pallas_lens",
  [],
  "if set, time *_pallas rows only at these lengths (each new length compiles the kernels again)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean("check", True, "run the GPU correctness check first", flag_values=FLAGS)
flags.DEFINE_boolean("check_only", False, "only run the correctness check", flag_values=FLAGS)
flags.DEFINE_integer(
  "check_dim",
  128,
  "head width K = V of the correctness check: a width the "
  "kernels take as it is (16, 32, 64, 128, 256; the ops pad others onto them)",
  flag_values=FLAGS,
)
flags.DEFINE_float(
  "time_budget_s",
  420.0,
  "stop timing new cells (and sweep specs) after this many seconds",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "sweep",
  [],
  "DeltaRuleConfig overrides to try on diag_kdn_pallas fwd+bwd at "
  "--sweep_len, each 'field=value/field=value' ('default': none), e.g. "
  "'num_warps_intra=2/block_v=32'; the fastest is used for the rows",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "gain_sweep",
  [],
  "GainConfig overrides to try on --gain_sweep_row, same "
  "syntax, e.g. 'max_chunk=128/num_stages_fwd=2'",
  flag_values=FLAGS,
)
flags.DEFINE_enum(
  "gain_sweep_row",
  "diag_gain_pallas",
  [
    "diag_gain_pallas",
    "iso_gain_pallas",
    "diag_kdn_pallas",
    "iso_kdn_pallas",
    "diag_kdn_seg_pallas",
    "iso_kdn_seg_pallas",
  ],
  "the row --gain_sweep times: a gain alone, or a KDN op (the gain inside it)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "gain_sweep_fwd_bwd",
  True,
  "rank the --gain_sweep specs by fwd+bwd (else by the forward alone)",
  flag_values=FLAGS,
)
flags.DEFINE_integer("sweep_len", 4096, "sequence length for the sweeps", flag_values=FLAGS)
flags.DEFINE_enum(
  "sweep_row",
  "diag_kdn_pallas",
  [
    "diag_kdn_pallas",
    "iso_kdn_pallas",
    "diag_kdn_seg_pallas",
    "iso_kdn_seg_pallas",
    "kda_pallas",
    "gdn_pallas",
  ],
  "the row --sweep times (fwd+bwd); the *_seg rows sweep the packed-documents path",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_stages",
  False,
  "time the pallas stages (see --stages) under every delta-rule sweep spec",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_fwd_only",
  False,
  "rank the --sweep specs by the forward alone (inference, or a forward-only kernel option)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_repeat_first",
  True,
  "time a sweep's first spec (its baseline) again "
  "after the others and rank it by that timing: a process's first timed spec can "
  "read slow (docs/decisions.md, --sweep_repeat_first)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "sweep_combine",
  True,
  "after a sweep, also time the first spec merged with every spec that beat it",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "stages_docs",
  False,
  "with --stages, also time the stages at the first length with packed documents (segment_ids)",
  flag_values=FLAGS,
)
flags.DEFINE_boolean(
  "stages",
  False,
  "also time the pallas stages one by one (diag KDN): the gain, then the delta rule's "
  "stages as the op runs them (pallas_kernels.delta_rule.forward_stages / "
  "backward_stages), each jitted alone",
  flag_values=FLAGS,
)


# ----------------------------------------------------------------------------------- inputs


def _inputs(key, b, t, h, d, dtype):
  ks = jax.random.split(key, 8)
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(jax.random.normal(ks[0], (b, t, h, d), jnp.float32)).astype(dtype)
  k = l2(jax.random.normal(ks[1], (b, t, h, d), jnp.float32)).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, h, d), jnp.float32).astype(dtype)
  la = (-0.1 * jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, d)))).astype(dtype)
  om = (0.1 * jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d)))).astype(dtype)
  r = (0.01 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))).astype(dtype)
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (b, t, h))).astype(dtype)
  return dict(q=q, k=k, v=v, la=la, om=om, r=r, beta=beta, om_iso=om[..., 0], la_scalar=la[..., 0])


def _ops():
  try:
    from kdn_jax import ops  # pylint: disable=g-import-not-at-top

    return ops
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("kdn_jax.ops unavailable: %s", e)
    return None


def _kernels(kernels):
  """kernels (a pallas_kernels.KernelConfigs) or, for None, the tuned configs."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  return pk.KernelConfigs() if kernels is None else kernels


def _direct_kdn(diag, x, d, kernels=None):
  """KDN mixer straight from the pallas kernels (gain, then memory)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  kernels = _kernels(kernels)
  b, _, h, _ = x["k"].shape
  mu = jnp.full((h,), float(d), jnp.float32)
  s0 = jnp.zeros((b, h, d, d), jnp.float32)
  gkw = dict(config=kernels.gain)
  if diag:
    p0 = jnp.ones((b, h, d), jnp.float32)
    w, _ = pk.diag_gain(x["k"], x["la"], x["om"], x["r"], mu, p0, **gkw)
  else:
    # (beta itself: the delta rule forms the write beta k in its kernels)
    p0 = jnp.ones((b, h), jnp.float32)
    w, _ = pk.iso_gain(x["k"], x["la"], x["om_iso"], x["r"], mu, p0, **gkw)
  o, _ = pk.delta_rule(x["q"], x["k"], x["v"], x["la"], w, d**-0.5, s0, config=kernels.delta_rule)
  return o


_DOC_LEN = 1000  # document length of the *_seg rows (not a multiple of any chunk)


def _is_docs_row(row):
  """diag_kdn_seg_<impl> / iso_kdn_seg_<impl>: the op with packed documents."""
  return row.rsplit("_", 1)[0].endswith("_seg")


def _doc_ids(b, t):
  """segment_ids [b, t] of packed documents of _DOC_LEN tokens."""
  return jnp.broadcast_to(jnp.arange(t) // _DOC_LEN, (b, t)).astype(jnp.int32)


def _make_jax_fn(row, d, kernels=None):
  """Returns f(x) -> output array (differentiable in the float inputs); kernels: the Pallas
  kernels' configs (a pallas_kernels.KernelConfigs; None: the tuned ones)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  kernels = _kernels(kernels)

  ops = _ops()
  name, impl = row.rsplit("_", 1)
  docs = _is_docs_row(row)  # packed documents: segment_ids with a reset every _DOC_LEN
  name = name[:-4] if docs else name
  if docs and (name not in ("diag_kdn", "iso_kdn") or ops is None):
    raise ValueError(
      f"row {row!r}: the _seg rows are diag_kdn_seg_<impl> and iso_kdn_seg_<impl> "
      "(through kdn_jax.ops)"
    )
  if name in ("diag_kdn", "iso_kdn"):
    diag = name == "diag_kdn"
    if ops is not None:
      fn = ops.diag_kdn if diag else ops.iso_kdn

      def f(x):
        om = x["om"] if diag else x["om_iso"]
        b, t = x["q"].shape[:2]
        seg = _doc_ids(b, t) if docs else None
        return fn(
          x["q"],
          x["k"],
          x["v"],
          x["la"],
          om,
          x["r"],
          info_scale=float(d),
          segment_ids=seg,
          impl=impl,
          kernel_config=kernels,
        )[0]

      return f, ("q", "k", "v", "la", "om" if diag else "om_iso", "r")
    if impl != "pallas":
      raise RuntimeError("kdn_jax.ops unavailable")
    return (lambda x: _direct_kdn(diag, x, d, kernels)), (
      "q",
      "k",
      "v",
      "la",
      "om" if diag else "om_iso",
      "r",
    )
  if name == "diag_gain":

    def f(x):
      b, _, h, _ = x["k"].shape
      return pk.diag_gain(
        x["k"],
        x["la"],
        x["om"],
        x["r"],
        jnp.full((h,), float(d)),
        jnp.ones((b, h, d), jnp.float32),
        config=kernels.gain,
      )[0]

    return f, ("k", "la", "om", "r")
  if name == "iso_gain":

    def f(x):
      b, _, h, _ = x["k"].shape
      return pk.iso_gain(
        x["k"],
        x["la"],
        x["om_iso"],
        x["r"],
        jnp.full((h,), float(d)),
        jnp.ones((b, h), jnp.float32),
        config=kernels.gain,
      )[0]

    return f, ("k", "la", "om_iso", "r")
  if name in ("kda", "gdn"):
    if ops is None:
      raise RuntimeError("kdn_jax.ops unavailable")
    la = "la" if name == "kda" else "la_scalar"
    fn = ops.kda if name == "kda" else ops.gated_delta_rule

    def f(x):
      return fn(x["q"], x["k"], x["v"], x[la], x["beta"], impl=impl, kernel_config=kernels)[0]

    return f, ("q", "k", "v", la, "beta")
  raise ValueError(row)


def _time_fn(fn, args, compile_times=None, name=None):
  """Median ms of --reps runs after one compiling call and --warmup untimed runs.

  With `compile_times` (a dict), the first call's wall time (compilation included) is stored there."""
  if compile_times is not None:
    t0 = time.time()
    jax.block_until_ready(fn(*args))
    compile_times[name] = round(time.time() - t0, 2)
  return median_time(fn, *args, warmup=1 + FLAGS.warmup, repeats=FLAGS.reps)


def time_jax_row(row, t, fwd_bwd, compile_times=None, kernels=None):
  fn, args = jax_row_fn(row, t, fwd_bwd, kernels)
  return _time_fn(fn, args, compile_times, row)


def jax_row_fn(row, t, fwd_bwd, kernels=None):
  """(jitted fn, args) of a JAX row: the forward, or the gradient of a loss on its output;
  kernels: the Pallas kernels' configs (None: the tuned ones)."""
  b, h, d = FLAGS.batch, FLAGS.heads, FLAGS.dim
  x = _inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16)
  f, names = _make_jax_fn(row, d, kernels)
  diff = {n: x[n] for n in names}
  rest = {n: v for n, v in x.items() if n not in names}
  if not fwd_bwd:
    fn = jax.jit(lambda diff: f({**rest, **diff}))
  else:

    def loss(diff):
      o = f({**rest, **diff})
      return jnp.sum(o.astype(jnp.float32) * 1e-3)

    fn = jax.jit(jax.grad(loss))
  return fn, (diff,)


# ------------------------------------------------------------------------------------- fla


def _fla():
  mods, reason = import_for_cuda("fla.ops.kda", "fla.ops.gated_delta_rule")
  if mods is None:
    logging.warning("fla unavailable: %s", reason)
    return None
  torch, kda, gdn = mods
  return torch, kda.chunk_kda, gdn.chunk_gated_delta_rule


def time_fla_row(row, t, fwd_bwd):
  torch, run = fla_row_fn(row, t, fwd_bwd)
  with torch.set_grad_enabled(fwd_bwd):
    return torch_cuda_median_ms(run, warmup=1 + FLAGS.warmup, repeats=FLAGS.reps)


def fla_row_fn(row, t, fwd_bwd):
  """(torch, run): one call of fla's op on fresh inputs (run under torch.set_grad_enabled)."""
  torch, chunk_kda, chunk_gdn = _fla()
  b, h, d = FLAGS.batch, FLAGS.heads, FLAGS.dim
  g = torch.Generator(device="cuda").manual_seed(0)
  dev, bf = "cuda", torch.bfloat16
  rn = lambda *s: torch.randn(*s, device=dev, generator=g)
  l2 = lambda z: z / z.norm(dim=-1, keepdim=True)
  q = l2(rn(b, t, h, d)).to(bf)
  k = l2(rn(b, t, h, d)).to(bf)
  v = rn(b, t, h, d).to(bf)
  beta = torch.sigmoid(rn(b, t, h)).to(bf)
  if row == "fla_chunk_kda":
    gate = (-0.1 * torch.nn.functional.softplus(rn(b, t, h, d))).float()
    fn = chunk_kda
  else:
    gate = (-0.1 * torch.nn.functional.softplus(rn(b, t, h))).float()
    fn = chunk_gdn
  leaves = [q, k, v, gate, beta]
  if fwd_bwd:
    for z in leaves:
      z.requires_grad_(True)
  do = rn(b, t, h, d).to(bf)

  def run():
    o = fn(q, k, v, gate, beta, scale=d**-0.5)[0]
    if fwd_bwd:
      torch.autograd.grad(o, leaves, do)
    return o

  return torch, run


# ------------------------------------------------------------------------------------ check


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-300)))


# The accuracy bounds: (forward, gradients) for fp32 and for bf16 inputs.
CHECK_BOUNDS = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 1e-2)}


def check_violations(res):
  """Names of run_check results above CHECK_BOUNDS, with their values."""
  bad = {}
  for name, err in res.items():
    fwd = name.endswith(("_o", "_S", "_kappa", "_pfin"))
    dtype = "float32" if "float32" in name else "bfloat16"
    if not err <= CHECK_BOUNDS[dtype][0 if fwd else 1]:
      bad[name] = err
  return bad


def _gain_scan(diag, k, la, om, r, mu, p0, seg):
  """The KDN gain as a plain token scan of kdn_jax.ops.variance's steps (a reset where seg
  changes): (gain, p_final)."""
  from kdn_jax.ops import variance  # pylint: disable=g-import-not-at-top

  step_fn = variance.diag_variance_step if diag else variance.iso_variance_step
  mu = mu[:, None] if diag else mu  # against [B, H, K] (diag) or [B, H] (iso) rows

  def step(p, xs):
    kt, lat, omt, rt, st = xs
    p = jnp.where(st.reshape(st.shape + (1,) * (p.ndim - 1)), p0, p)
    gain, _, p = step_fn(p, kt, lat, omt, rt, mu)
    return p, gain

  xs = tuple(jnp.moveaxis(z, 1, 0) for z in (k, la, om, r, variance.segment_starts(seg)))
  p, gain = jax.lax.scan(step, p0, xs)
  return jnp.moveaxis(gain, 0, 1), p


def _gain_check(pk, x, seg, tag, b, h, d, kernels):
  """diag/iso gain (Pallas, with the reset of `seg`) against _gain_scan: the gain, the final
  variance and the gradients of k, log_alpha, omega, r, info_scale and p0."""
  res = {}
  for diag in (True, False):
    mode = "diag" if diag else "iso"
    fn = pk.diag_gain if diag else pk.iso_gain
    om = x["om"] if diag else x["om_iso"]
    p0 = jnp.full((b, h, d) if diag else (b, h), 0.5)
    args = (x["k"], x["la"], om, x["r"], jnp.full((h,), float(d)), p0)
    ct = jax.random.normal(jax.random.PRNGKey(4), x["k"].shape if diag else x["r"].shape)
    f_pk = lambda *a, fn=fn: fn(*a, seg, config=kernels.gain)

    def f_ref(*a, diag=diag):
      return _gain_scan(diag, *(z.astype(jnp.float32) for z in a), seg)

    _compare(
      res,
      f"{mode}_gain_{tag}_",
      f_pk,
      f_ref,
      args,
      ct,
      ("kappa", "pfin"),
      ("dk", "dla", "dom", "dr", "dmu", "dp0"),
    )
  return res


def _kdn_op_check(x, seg, tag, d, ct, kernels):
  """The diag and iso KDN ops (impl='pallas', with the reset of `seg`) against their fp32 token
  loops (impl='reference'): what the op adds to the kernels (the gain's kappa stored for the
  delta rule, pallas_kernels.write_dtype; the iso write beta k formed in the kernels)."""
  from kdn_jax import ops  # pylint: disable=g-import-not-at-top

  res = {}
  for diag in (True, False):
    fn = ops.diag_kdn if diag else ops.iso_kdn
    args = (x["q"], x["k"], x["v"], x["la"], x["om"] if diag else x["om_iso"], x["r"])

    def f_op(*a, fn=fn, impl="pallas"):
      o, st = fn(
        *a,
        info_scale=float(d),
        segment_ids=seg,
        impl=impl,
        output_final_state=True,
        kernel_config=kernels,
      )
      return o, st.memory

    def f_ref(*a, f_op=f_op):
      with jax.default_matmul_precision("highest"):
        return f_op(*(z.astype(jnp.float32) for z in a), impl="reference")

    _compare(
      res,
      f"{'diag' if diag else 'iso'}_kdn_{tag}_seg_",
      f_op,
      f_ref,
      args,
      ct,
      ("o", "S"),
      ("dq", "dk", "dv", "dla", "dom", "dr"),
    )
  return res


def _compare(res, prefix, fa, fb, args, ct, out_names, grad_names):
  """res[prefix + name]: relative RMS error of fa against fb, for every output and for the
  gradients of sum(out_0 * ct) + the sums of the other outputs w.r.t. every argument."""

  def loss(fn):
    def f(*a):
      out0, *rest = fn(*a)
      return jnp.sum(out0.astype(jnp.float32) * ct) + sum(jnp.sum(o) for o in rest)

    return f

  for n, a1, a2 in zip(out_names, jax.jit(fa)(*args), jax.jit(fb)(*args)):
    res[prefix + n] = _rel(a1, a2)
  argnums = tuple(range(len(args)))
  try:
    g1 = jax.jit(jax.grad(loss(fa), argnums=argnums))(*args)
  except Exception as e:  # pylint: disable=broad-except
    # A backward that fails to compile or run (e.g. a kernel over the shared-memory limit) fails
    # the check (NaN is above every bound) but keeps the forward's errors and the other cases.
    logging.error("check %s: gradients failed: %s", prefix, f"{type(e).__name__}: {e}"[:500])
    res.update({prefix + n: float("nan") for n in grad_names})
    return
  g2 = jax.jit(jax.grad(loss(fb), argnums=argnums))(*args)
  for n, a1, a2 in zip(grad_names, g1, g2):
    res[prefix + n] = _rel(a1, a2)


def run_check(b=2, t=300, h=2, d=128, cut=100, kernels=None):
  """Relative RMS errors of the Pallas delta rule and the diag and iso gains (with `kernels`, a
  pallas_kernels.KernelConfigs; None: the tuned configs) against plain fp32 scans, fp32 and
  bf16 inputs, without and with a segment reset at token `cut` (the gains: with it)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  kernels = _kernels(kernels)
  from kdn_jax.ops.delta_reference import delta_rule_reference  # pylint: disable=g-import-not-at-top

  res = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    x = _inputs(jax.random.PRNGKey(1), b, t, h, d, dtype)
    w = 0.5 * x["beta"][..., None].astype(jnp.float32) * x["k"].astype(jnp.float32)
    s0 = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (b, h, d, d))
    seg = (jnp.arange(t)[None, :] >= cut).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32)
    args = (x["q"], x["k"], x["v"], x["la"], w, s0)

    def f_pk(*a):
      return pk.delta_rule(*a[:5], d**-0.5, a[5], config=kernels.delta_rule)

    def f_ref(*a):  # kdn_jax's float32 token loop (q arrives scaled)
      q, *rest = (z.astype(jnp.float32) for z in a)
      with jax.default_matmul_precision("highest"):
        return delta_rule_reference(d**-0.5 * q, *rest)

    def f_pk_seg(*a):
      return pk.delta_rule(*a[:5], d**-0.5, a[5], seg, config=kernels.delta_rule)

    def f_ref_seg(*a):  # the reset at token `cut` = two independent runs from s0
      o_a, _ = f_ref(*(z[:, :cut] for z in a[:5]), a[5])
      o_b, s_b = f_ref(*(z[:, cut:] for z in a[:5]), a[5])
      return jnp.concatenate([o_a, o_b], axis=1), s_b

    tag = jnp.dtype(dtype).name
    ct = jax.random.normal(jax.random.PRNGKey(3), (b, t, h, d))
    for name, fa, fb in (("", f_pk, f_ref), ("seg_", f_pk_seg, f_ref_seg)):
      _compare(
        res,
        f"delta_rule_{tag}_{name}",
        fa,
        fb,
        args,
        ct,
        ("o", "S"),
        ("dq", "dk", "dv", "dla", "dw", "dh0"),
      )
    # the write as a per-token scalar (write = beta k, formed in the kernels; KDA's, the iso
    # KDN's), with the reset: beta's gradient is "dbeta"
    beta_args = args[:4] + (0.5 * x["beta"].astype(jnp.float32),) + args[5:]
    f_ref_beta = lambda *a: f_ref_seg(*a[:4], a[4][..., None] * a[1].astype(jnp.float32), a[5])
    _compare(
      res,
      f"delta_rule_{tag}_seg_beta_",
      f_pk_seg,
      f_ref_beta,
      beta_args,
      ct,
      ("o", "S"),
      ("dq", "dk", "dv", "dla", "dbeta", "dh0"),
    )
    res.update(_gain_check(pk, x, seg, tag, b, h, d, kernels))
    res.update(_kdn_op_check(x, seg, tag, d, ct, kernels))
  for kname, val in res.items():
    logging.info("check %s: %.3g", kname, val)
    print(f"check {kname}: {val:.3g}", flush=True)
  return res


# ------------------------------------------------------------------------------------- main


class _StageTimer:
  """A delta-rule stage runner (pallas_kernels/delta_rule/stages.py) that times each stage the
  op runs, jitted alone with the op's own arguments, into out[prefix + stage name], and hands
  the stage's results on to the next."""

  def __init__(self, prefix, out, first):
    self.prefix, self.out, self.first = prefix, out, first

  def __call__(self, name, fn, *arrays, **static):
    key = self.prefix + name
    # (arrays as arguments: closed-over arrays become constants that XLA folds for minutes)
    stage = jax.jit(functools.partial(fn, **static))
    self.out[key] = _time_fn(stage, arrays, self.first, key)
    return stage(*arrays)


def _time_stages(t, docs=False, kernels=None):
  """Per-stage times (ms) of the diag-KDN Pallas path at length t: the gain ("gain_fwd"), then
  the delta rule's stages as the op runs them (its forward_stages / backward_stages, each stage
  jitted alone): "fwd/<stage>" for a differentiated call's forward (which saves the
  residuals), "fwd_only/<stage>" for a call not differentiated, "bwd/<stage>", and each
  group's "<group>/sum". docs: packed documents of _DOC_LEN tokens (segment_ids); kernels: the
  configs (None: the tuned ones)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  from pallas_kernels.delta_rule import (  # pylint: disable=g-import-not-at-top
    backward_stages,
    forward_stages,
    stage_inputs,
  )

  b, h, d = FLAGS.batch, FLAGS.heads, FLAGS.dim
  x = _inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16)
  kernels = _kernels(kernels)
  seg = _doc_ids(b, t) if docs else None
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
  out["gain_fwd"] = _time_fn(gain, gargs, first, "gain_fwd")
  h0 = jnp.zeros((b, h, d, d), jnp.float32)
  args, static = stage_inputs(
    x["q"], x["k"], x["v"], x["la"], gain(*gargs), d**-0.5, h0, seg, config=kernels.delta_rule
  )
  saved = forward_stages(*args, **static, save=True, run=_StageTimer("fwd/", out, first))
  forward_stages(*args, **static, save=False, run=_StageTimer("fwd_only/", out, first))
  q, k, v, w, _, h0, starts, cont, pid = args
  (o, sfin, g), residuals = saved[:3], saved[3:]
  cts = (jnp.ones_like(o), jnp.zeros_like(sfin))
  backward_stages(
    *(q, k, v, w, g, h0, starts, cont, pid),
    *residuals,
    *cts,
    **static,
    run=_StageTimer("bwd/", out, first),
  )
  for group in ("fwd/", "fwd_only/", "bwd/"):
    out[group + "sum"] = sum(ms for name, ms in list(out.items()) if name.startswith(group))
  out["first_call_s"] = first
  return out


def _sweep(
  results,
  specs,
  kernels,
  family,
  make_config,
  row,
  fwd_bwd,
  key,
  deadline,
  stages=False,
  save=lambda: None,
):
  """Times `row` at --sweep_len under `kernels` (a pallas_kernels.KernelConfigs) with its
  `family` member replaced by make_config(spec) for each spec (with the pallas stage split when
  `stages`) until time.time() passes `deadline`; with --sweep_repeat_first the first spec is
  timed again after the others (a record with "repeat": true, no stage split) and ranks by that
  timing; with --sweep_combine, the specs that beat the first one are merged into one more spec
  and timed too. Returns `kernels` with the fastest config (recorded under results[key]), or
  unchanged if none ran."""
  timed = []  # (spec, ms or None, config)

  def run(spec, repeat=False):
    if time.time() > deadline:
      logging.warning("time budget spent: sweep %s not timed", spec)
      results.setdefault("sweeps", []).append({"sweep": spec, "skipped": "time budget"})
      save()
      return
    cfg = make_config(spec)
    trial = dataclasses.replace(kernels, **{family: cfg})
    first = {}
    try:
      ms = time_jax_row(row, FLAGS.sweep_len, fwd_bwd, first, trial)
    except Exception as e:  # pylint: disable=broad-except
      ms = None
      logging.warning("sweep %s failed: %s", spec, e)
    rec = {
      "sweep": spec,
      "row": row,
      "fwd_bwd": fwd_bwd,
      "T": FLAGS.sweep_len,
      "ms": ms,
      "first_call_s": first.get(row),
    }
    if repeat:
      rec["repeat"] = True
    if stages and ms is not None and not repeat:
      try:
        rec["stages"] = {
          k: v if isinstance(v, dict) else round(v, 3)
          for k, v in _time_stages(FLAGS.sweep_len, _is_docs_row(row), trial).items()
        }
      except Exception as e:  # pylint: disable=broad-except
        rec["stages_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(rec), flush=True)
    results.setdefault("sweeps", []).append(rec)
    if repeat:  # (a failed repeat keeps the first timing)
      timed[0] = (spec, ms if ms is not None else timed[0][1], cfg)
    else:
      timed.append((spec, ms, cfg))
    save()

  for spec in specs:
    run(spec)
  if (
    FLAGS.sweep_repeat_first
    and len(specs) > 1
    and len(timed) == len(specs)
    and timed[0][1] is not None
  ):
    run(specs[0], repeat=True)
  if FLAGS.sweep_combine and timed and len(timed) == len(specs):
    combined = combine_winners([(spec, ms) for spec, ms, _ in timed])
    if combined is not None and combined not in specs:
      run(combined)
  ok = [(ms, cfg) for _, ms, cfg in timed if ms is not None]
  if not ok:
    return kernels
  best = min(ok, key=lambda m: m[0])[1]
  results[key] = repr(best)
  return dataclasses.replace(kernels, **{family: best})


def combine_winners(timed):
  """The first spec plus the overrides of every later spec that beat it (None if < 2 did); when
  winners set the same field, the faster spec's value is kept."""
  (base, base_ms), rest = timed[0], timed[1:]
  if base_ms is None:
    return None
  wins = sorted(((ms, spec) for spec, ms in rest if ms is not None and ms < base_ms), reverse=True)
  if len(wins) < 2:
    return None
  fields = {}
  for spec in [base] + [spec for _, spec in wins]:  # slowest winner first, fastest last
    if spec not in ("", "default"):
      fields.update(item.partition("=")[::2] for item in spec.split("/"))
  return "/".join(f"{k}={v}" for k, v in fields.items())


def _sweeps(results, deadline, save):
  """The KernelConfigs the rows run with: the tuned configs, each family's sweep winner."""
  from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

  base, gbase = tuned.tuned("delta_rule"), tuned.tuned("gain")
  kernels = _sweep(
    results,
    FLAGS.sweep,
    tuned.KernelConfigs(delta_rule=base, gain=gbase),
    "delta_rule",
    lambda spec: config_from_spec(base, spec),
    FLAGS.sweep_row,
    not FLAGS.sweep_fwd_only,
    "delta_rule_config",
    deadline,
    stages=FLAGS.sweep_stages,
    save=save,
  )
  kernels = _sweep(
    results,
    FLAGS.gain_sweep,
    kernels,
    "gain",
    lambda spec: config_from_spec(gbase, spec),
    FLAGS.gain_sweep_row,
    FLAGS.gain_sweep_fwd_bwd,
    "gain_config",
    deadline,
    save=save,
  )
  print("configs:", results.get("delta_rule_config"), results.get("gain_config"), flush=True)
  return kernels


def _replace_file(path, text):
  """Writes `path` whole or not at all (a kill mid-write leaves the previous version)."""
  with open(path + ".tmp", "w") as fh:
    fh.write(text)
  os.replace(path + ".tmp", path)


def _write(results, out, plot=True):
  """results.json, results.md (the table) and, with `plot`, results.png under `out`. main calls it
  (without the plot) after every cell, so a run killed by its time limit keeps what it timed."""
  os.makedirs(out, exist_ok=True)
  _replace_file(os.path.join(out, "results.json"), json.dumps(results, indent=1))
  lens = sorted({int(r["T"]) for r in results["rows"]})
  lines = [
    "| row | mode | " + " | ".join(f"T={t}" for t in lens) + " |",
    "|---|---|" + "---|" * len(lens),
  ]
  keys = sorted({(r["row"], r["mode"]) for r in results["rows"]})
  for row, mode in keys:
    cells = []
    for t in lens:
      m = [r for r in results["rows"] if r["row"] == row and r["mode"] == mode and r["T"] == t]
      if not m:
        cells.append("")
      elif m[0].get("ms") is None:
        cells.append("err: " + m[0].get("error", "")[:40].replace("|", "/"))
      else:
        cells.append(f"{m[0]['ms']:.2f}")
    lines.append(f"| {row} | {mode} | " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  hdr = (
    f"Mixer timings in ms (median of {FLAGS.reps}), batch {FLAGS.batch}, "
    f"{FLAGS.heads} heads x {FLAGS.dim}, bf16, device: {results.get('device')}\n\n"
  )
  if results.get("delta_rule_config"):
    hdr += f"Pallas delta-rule config: `{results['delta_rule_config']}`\n\n"
  if results.get("gain_config"):
    hdr += f"Pallas gain config: `{results['gain_config']}`\n\n"
  if results.get("check_failed"):
    hdr += f"**This config FAILED the GPU check:** {results['check_failed']}\n\n"
  if not lens:
    table = "(no rows timed)"
  _replace_file(os.path.join(out, "results.md"), hdr + table + "\n")
  if not plot:
    return table
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
      for row, m in keys:
        if m != mode:
          continue
        pts = sorted(
          (r["T"], r["ms"])
          for r in results["rows"]
          if r["row"] == row and r["mode"] == mode and r.get("ms") is not None
        )
        if pts:
          ax.plot(*zip(*pts), marker="o", label=row)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("T")
      ax.set_ylabel("ms")
      ax.set_title(mode)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=100)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("plot failed: %s", e)
  return table


def main(argv):
  del argv
  results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": []}
  start = time.time()
  save = lambda: _write(results, FLAGS.out, plot=False)  # after every step: a killed run keeps it
  # Sweeps first, so that the check covers the configuration the rows use.
  kernels = _sweeps(results, start + FLAGS.time_budget_s, save)
  results.setdefault("delta_rule_config", repr(kernels.delta_rule))
  results.setdefault("gain_config", repr(kernels.gain))  # (both: the rows run with them)
  save()
  if FLAGS.check or FLAGS.check_only:
    try:
      results["check"] = run_check(d=FLAGS.check_dim, kernels=kernels)
      bad = check_violations(results["check"])
      if bad:  # the rows still run (they time this config), but the report says it is wrong
        results["check_failed"] = bad
        logging.error("GPU CHECK FAILED for %s: %s", results.get("delta_rule_config"), bad)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      results["check_error"] = repr(e)[:2000]
    if FLAGS.check_only:
      _write(results, FLAGS.out)
      return
    save()
  have_fla = _fla() is not None
  if FLAGS.stages:
    for t, docs in [(int(z), False) for z in FLAGS.seq_lens[:2]] + (
      [(int(FLAGS.seq_lens[0]), True)] if FLAGS.stages_docs else []
    ):
      try:
        rec = {"stages": _time_stages(t, docs, kernels), "T": t, "docs": docs}
      except Exception as e:  # pylint: disable=broad-except
        rec = {"stages_error": f"{type(e).__name__}: {e}"[:500], "T": t, "docs": docs}
      print(json.dumps(rec), flush=True)
      results.setdefault("stage_times", []).append(rec)
      save()
  for t in (int(s) for s in FLAGS.seq_lens):
    for row in FLAGS.rows:
      if row.startswith("fla") and not have_fla:
        continue
      if row.endswith("chunked") and t > FLAGS.chunked_max_len:
        continue
      if row.endswith("pallas") and FLAGS.pallas_lens and str(t) not in FLAGS.pallas_lens:
        continue
      for mode in ("fwd", "fwd+bwd"):
        if time.time() - start > FLAGS.time_budget_s:
          continue
        rec = {"row": row, "mode": mode, "T": t}
        try:
          fb = mode == "fwd+bwd"
          rec["ms"] = (
            time_fla_row(row, t, fb)
            if row.startswith("fla")
            else time_jax_row(row, t, fb, kernels=kernels)
          )
        except Exception as e:  # pylint: disable=broad-except
          rec["ms"] = None
          rec["error"] = f"{type(e).__name__}: {e}"[:300]
          logging.warning("%s %s T=%d failed: %s", row, mode, t, traceback.format_exc()[-1500:])
        print(json.dumps(rec), flush=True)
        results["rows"].append(rec)
        save()
  print(_write(results, FLAGS.out))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
