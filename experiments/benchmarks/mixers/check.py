"""The mixers benchmark's GPU exactness check (``--check_only``): the Pallas delta rule, the diag
and iso KDN gains and the KDN ops against plain fp32 scans, at fp32 and bf16 inputs, with and
without a segment reset; each error a relative RMS, held to CHECK_BOUNDS. On CPU the kernels run
in interpret mode, which does not compile the Triton code: run it on a GPU after a kernel change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments.benchmarks.mixers import arg_specs


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

    names = ("kappa", "pfin"), ("dk", "dla", "dom", "dr", "dmu", "dp0")
    _compare(res, f"{mode}_gain_{tag}_", f_pk, f_ref, args, ct, *names)
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

    names = ("o", "S"), ("dq", "dk", "dv", "dla", "dom", "dr")
    _compare(res, f"{'diag' if diag else 'iso'}_kdn_{tag}_seg_", f_op, f_ref, args, ct, *names)
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

  kernels = arg_specs.kernels_or_tuned(kernels)
  from kdn_jax.ops.delta_reference import delta_rule_reference  # pylint: disable=g-import-not-at-top

  res = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    x = arg_specs.inputs(jax.random.PRNGKey(1), b, t, h, d, dtype)
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
