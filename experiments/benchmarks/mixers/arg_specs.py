"""What the mixers benchmark runs: the rows (an op and its implementation), the shape and the
inputs each row is called with, in JAX and (the fla rows) in PyTorch.

A row is ``<op>_<impl>``: ``diag_kdn``, ``iso_kdn``, ``kda``, ``gdn`` through kdn_jax.ops at
``impl`` (pallas, chunked, reference); ``diag_gain`` / ``iso_gain``: the KDN gain kernel alone;
``diag_kdn_seg_<impl>`` / ``iso_kdn_seg_<impl>``: the op over packed documents of ``DOC_LEN``
tokens (segment_ids); ``fla_chunk_kda`` / ``fla_chunk_gdn``: fla's Triton kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from absl import logging

from experiments.benchmarks.timing import import_for_cuda

ROWS = (
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
)
# the rows a delta-rule sweep can time (fwd+bwd); the *_seg rows sweep the packed-documents path
SWEEP_ROWS = (
  "diag_kdn_pallas",
  "iso_kdn_pallas",
  "diag_kdn_seg_pallas",
  "iso_kdn_seg_pallas",
  "kda_pallas",
  "gdn_pallas",
)
# the rows a gain sweep can time: a gain alone, or a KDN op (the gain inside it)
GAIN_SWEEP_ROWS = (
  "diag_gain_pallas",
  "iso_gain_pallas",
  "diag_kdn_pallas",
  "iso_kdn_pallas",
  "diag_kdn_seg_pallas",
  "iso_kdn_seg_pallas",
)

DOC_LEN = 1000  # document length of the *_seg rows (not a multiple of any chunk)


@dataclasses.dataclass(frozen=True)
class Shape:
  """The rows' inputs: [batch, T, heads, dim] with K = V = dim; bf16 in the timed rows."""

  batch: int = 4
  heads: int = 16
  dim: int = 128


def inputs(key, b, t, h, d, dtype):
  """Every array a row may take: unit-norm q, k; v; log-decay la and omega om per channel (their
  [..., 0] slices for the scalar-decay and iso rows); r; beta."""
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


def kernels_or_tuned(kernels):
  """kernels (a pallas_kernels.KernelConfigs) or, for None, the tuned configs."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  return pk.KernelConfigs() if kernels is None else kernels


def is_docs_row(row):
  """diag_kdn_seg_<impl> / iso_kdn_seg_<impl>: the op with packed documents."""
  return row.rsplit("_", 1)[0].endswith("_seg")


def doc_ids(b, t):
  """segment_ids [b, t] of packed documents of DOC_LEN tokens."""
  return jnp.broadcast_to(jnp.arange(t) // DOC_LEN, (b, t)).astype(jnp.int32)


def make_jax_fn(row, d, kernels=None):
  """(f, names): f(x) -> the row's output (differentiable in the float inputs), names: the keys of
  inputs() it differentiates; kernels: the Pallas kernels' configs (a pallas_kernels.KernelConfigs;
  None: the tuned ones)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  from kdn_jax import ops  # pylint: disable=g-import-not-at-top

  kernels = kernels_or_tuned(kernels)
  name, impl = row.rsplit("_", 1)
  docs = is_docs_row(row)  # packed documents: segment_ids with a reset every DOC_LEN
  name = name[:-4] if docs else name
  if docs and name not in ("diag_kdn", "iso_kdn"):
    raise ValueError(f"row {row!r}: the _seg rows are diag_kdn_seg_<impl> and iso_kdn_seg_<impl>")
  if name in ("diag_kdn", "iso_kdn"):
    diag = name == "diag_kdn"
    fn = ops.diag_kdn if diag else ops.iso_kdn
    om = "om" if diag else "om_iso"

    def f(x):
      b, t = x["q"].shape[:2]
      seg = doc_ids(b, t) if docs else None
      return fn(
        x["q"],
        x["k"],
        x["v"],
        x["la"],
        x[om],
        x["r"],
        info_scale=float(d),
        segment_ids=seg,
        impl=impl,
        kernel_config=kernels,
      )[0]

    return f, ("q", "k", "v", "la", om, "r")
  if name in ("diag_gain", "iso_gain"):
    diag = name == "diag_gain"
    gain = pk.diag_gain if diag else pk.iso_gain
    om = "om" if diag else "om_iso"

    def f(x):
      b, _, h, _ = x["k"].shape
      p0 = jnp.ones((b, h, d) if diag else (b, h), jnp.float32)
      mu = jnp.full((h,), float(d))
      return gain(x["k"], x["la"], x[om], x["r"], mu, p0, config=kernels.gain)[0]

    return f, ("k", "la", om, "r")
  if name in ("kda", "gdn"):
    la = "la" if name == "kda" else "la_scalar"
    fn = ops.kda if name == "kda" else ops.gated_delta_rule

    def f(x):
      return fn(x["q"], x["k"], x["v"], x[la], x["beta"], impl=impl, kernel_config=kernels)[0]

    return f, ("q", "k", "v", la, "beta")
  raise ValueError(row)


def jax_row_fn(row, t, fwd_bwd, kernels=None, shape: Shape = Shape()):
  """(jitted fn, args) of a JAX row at length t: the forward, or the gradient of a loss on its
  output; kernels: the Pallas kernels' configs (None: the tuned ones)."""
  b, h, d = shape.batch, shape.heads, shape.dim
  x = inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16)
  f, names = make_jax_fn(row, d, kernels)
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


def fla():
  """(torch, chunk_kda, chunk_gated_delta_rule), or None where fla or a CUDA device is missing."""
  mods, reason = import_for_cuda("fla.ops.kda", "fla.ops.gated_delta_rule")
  if mods is None:
    logging.warning("fla unavailable: %s", reason)
    return None
  torch, kda, gdn = mods
  return torch, kda.chunk_kda, gdn.chunk_gated_delta_rule


def fla_row_fn(row, t, fwd_bwd, shape: Shape = Shape()):
  """(torch, run): one call of fla's op on fresh inputs (run under torch.set_grad_enabled)."""
  torch, chunk_kda, chunk_gdn = fla()
  b, h, d = shape.batch, shape.heads, shape.dim
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
