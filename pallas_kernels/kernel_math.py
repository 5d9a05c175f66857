"""Elementwise math inside the kernel bodies (GPU and interpret mode; the TPU kernels keep jnp's).

Pallas lowers jnp.exp on fp32 to libdevice's expf for Triton: about 1 ulp, in ~10 instructions
(range reduction, then one MUFU.EX2). 16-bit data do not need that: exp_for(bf16) is
2^(x log2 e), which Triton lowers to libdevice's exp2f = one MUFU.EX2 after a multiply, with a
relative error of about 2^-22 + |x| 2^-24 (the rounding of x log2 e), far under bf16's 2^-8.
flash-linear-attention's kernels compute every exp that way (tl.exp, exp2 of log2-scaled gates).
jnp.log1p lowers to libdevice's log1pf (~30 instructions, with branches); softplus_for(bf16)
replaces it by a short series. fp32 (and wider) data keep jnp's functions, as their dots stay
fp32-accurate (common.precision_for). The delta-rule kernels all take exp_for_mode(the call's
precision mode): one choice for all of them, also where a traced scale folds q into fp32; the
gains, the conv and the norm take exp_for(their data's dtype). Static SASS for sm_90
(experiments/benchmarks/kernel_dev/kernel_sass.py) counts the instructions this saves per step:
docs/decisions.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common

LOG2E = 1.4426950408889634


def _exp2_scaled(x):
  return jnp.exp2(x * LOG2E)


def exp_for_mode(mode):
  """e^x for kernels of precision mode `mode` (common.PRECISIONS: 'fast' is 16-bit data):
  2^(x log2 e) for 'fast', jnp.exp for 'exact'."""
  if mode not in common.PRECISIONS:
    raise ValueError(f"exp_for_mode: mode={mode!r}; expected one of {common.PRECISIONS}")
  return _exp2_scaled if mode == "fast" else jnp.exp


def exp_for(dtype):
  """e^x for a kernel whose data arrive in `dtype` (exp_for_mode of common.precision_for)."""
  return exp_for_mode(common.precision_for(dtype))


def sigmoid(x, exp):
  """1 / (1 + e^-x) with `exp` (exp_for's: no default, so a kernel cannot fall back to the slow
  one unasked); e^-x overflowing at very negative x gives 1 / inf = 0, the right limit."""
  return 1.0 / (1.0 + exp(-x))


def softplus(x):
  """log(1 + e^x) in jax.nn.softplus' form (logaddexp(x, 0)), from primitives every Pallas
  backend lowers."""
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _log1p_unit_fast(e):
  """log(1 + e) for e in [0, 1] in a few multiply-adds (libdevice's log1pf, which jnp.log1p
  lowers to, and its log2f both run a ~30-instruction polynomial with branches): with
  s = e / (2 + e) in [0, 1/3], log(1 + e) = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ... + s^10/11),
  truncated there: relative error about s^12 / 13, at most 1.6e-7 (e = 1), plus the roundings."""
  s = e / (2.0 + e)
  t = s * s
  p = 1.0 / 11.0
  for c in (1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0):
    p = c + t * p
  return 2.0 * s * p


def softplus_for(dtype):
  """softplus for a kernel whose data arrive in `dtype`: for 16-bit data exp_for's exp and
  _log1p_unit_fast, else softplus with jnp's exp and log1p."""
  if common.precision_for(dtype) == "exact":
    return softplus
  return lambda x: jnp.maximum(x, 0.0) + _log1p_unit_fast(_exp2_scaled(-jnp.abs(x)))
