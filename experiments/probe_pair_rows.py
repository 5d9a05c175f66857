"""Where the chunk-64 pair-rows kernel's time goes (issue 18; GPU only): variants of
intra._pair_rows_kernel, timed at B=4, H=16, K=128, bf16, T=4096 and 16384.

  python -m experiments.probe_pair_rows /tmp/pair_rows_probe.json

Rows: diag_{cols,rows}_c16_nw{2,4} (session 32: the chunk-16 pair kernel's diagonal tile by
the shipped column loop, or row by row with contiguous row stores); cols_nw{4,8},
cols_chunk_nw{4,8}, cols_diag_only (the chunk-64 structure before session 32: diagonal tile by
column stores, intra._diag_columns, and one small dot per earlier block under pl.when; per
(chunk, row block) / one program per chunk / without the off-diagonal dots); shipped_pairs
(intra.pair_rows_forward itself: since session 32 the earlier blocks as one [16, K] x [K, 64]
dot with a masked row store, session 31's one_dot variant, which this probe timed at 1.46 ms
against 1.93 at T=4096 before it was shipped); intra_c16 (the whole chunk-16 intra stage, pair
rows + WY). Session 29's rows of the carried-tile kernel went with its helper in session 31;
their numbers are in docs/benchmark_mixers.md. The variants drop segments: timing only."""
import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from experiments import timing
from pallas_kernels.delta_rule import intra as I
from pallas_kernels.delta_rule import config as dcfg
from pallas_kernels.delta_rule.tiles import (dot_nt, tile, ref_point, launch_params, BF16_OPERANDS)
from pallas_kernels.kernel_math import exp_for

def kern_cols(q_ref, k_ref, w_ref, g_ref, l_out, p_out, wt_out, *, off, scale, C=64, S=16):
  exp = exp_for(q_ref.dtype)   # (the shipped kernels' exp: kernel_math)
  # grid (b, h, c, i) like the shipped kernel; diagonal by column stores; dots only below it.
  b, h, c, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  t0 = c * C
  r0 = t0 + i * S
  q, k, g = (tile(x, b, r0, S, h) for x in (q_ref, k_ref, g_ref))
  I._diag_columns(q, k, g, w_ref, k_ref, g_ref, None, None, l_out, p_out, b, h, r0, i * S,
                  scale, S, exp)
  g0, xs = ref_point(g_ref, b, h, r0, S, 0, g, exp)
  kx, qx = k * xs, q * xs
  rows = pl.ds(r0, S)
  for j in range(C // S):
    cols = pl.ds(j * S, S)

    @pl.when(j < i)
    def _():
      if off:
        y = tile(w_ref, b, t0 + j * S, S, h) * exp(
            jnp.minimum(g0 - tile(g_ref, b, t0 + j * S, S, h), 0.0))
        lo, po = dot_nt(kx, y, BF16_OPERANDS), dot_nt(qx, y, BF16_OPERANDS)
      else:
        lo = po = jnp.zeros((S, S), jnp.float32)
      l_out[b, h, rows, cols] = lo
      p_out[b, h, rows, cols] = (scale * po).astype(p_out.dtype)

    @pl.when(j > i)
    def _():
      l_out[b, h, rows, cols] = jnp.zeros((S, S), jnp.float32)
      p_out[b, h, rows, cols] = jnp.zeros((S, S), p_out.dtype)
  wt_out[b, rows, h, :] = (tile(w_ref, b, r0, S, h) * exp(g)).astype(wt_out.dtype)


def kern_cols_chunk(q_ref, k_ref, w_ref, g_ref, l_out, p_out, wt_out, *, scale, C=64, S=16):
  exp = exp_for(q_ref.dtype)   # (the shipped kernels' exp: kernel_math)
  # grid (b, h, c): the chunk's row blocks in a static loop; diagonal by column stores.
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = c * C
  for i in range(C // S):
    r0 = t0 + i * S
    rows = pl.ds(r0, S)
    q, k, g = (tile(x, b, r0, S, h) for x in (q_ref, k_ref, g_ref))
    I._diag_columns(q, k, g, w_ref, k_ref, g_ref, None, None, l_out, p_out, b, h, r0, i * S,
                  scale, S, exp)
    if i:
      g0, xs = ref_point(g_ref, b, h, r0, S, 0, g, exp)
      kx, qx = k * xs, q * xs
    for j in range(C // S):
      cols = pl.ds(j * S, S)
      if j < i:
        y = tile(w_ref, b, t0 + j * S, S, h) * exp(
            jnp.minimum(g0 - tile(g_ref, b, t0 + j * S, S, h), 0.0))
        l_out[b, h, rows, cols] = dot_nt(kx, y, BF16_OPERANDS)
        p_out[b, h, rows, cols] = (scale * dot_nt(qx, y, BF16_OPERANDS)).astype(p_out.dtype)
      elif j > i:
        l_out[b, h, rows, cols] = jnp.zeros((S, S), jnp.float32)
        p_out[b, h, rows, cols] = jnp.zeros((S, S), p_out.dtype)
    wt_out[b, rows, h, :] = (tile(w_ref, b, r0, S, h) * exp(g)).astype(wt_out.dtype)


def kern_diag_rows(q_ref, k_ref, w_ref, g_ref, l_out, p_out, wt_out, *, scale, S=16):
  exp = exp_for(q_ref.dtype)   # (the shipped kernels' exp: kernel_math)
  # grid (b, h, c) at chunk S: the diagonal tile row by row, each row of L and P one contiguous
  # [S] store (the shipped column loop stores strided columns).
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0 = c * S
  w, g = tile(w_ref, b, r0, S, h), tile(g_ref, b, r0, S, h)
  col = lax.broadcasted_iota(jnp.int32, (S,), 0)

  def body(ii, carry):
    qi, ki, gi = (x[b, r0 + ii, h, :].astype(jnp.float32) for x in (q_ref, k_ref, g_ref))
    e = exp(jnp.minimum(gi[None, :] - g, 0.0)) * w
    l_out[b, h, r0 + ii, pl.ds(0, S)] = jnp.where(col < ii, jnp.sum(ki[None, :] * e, axis=1), 0.0)
    p_out[b, h, r0 + ii, pl.ds(0, S)] = (scale * jnp.where(
        col <= ii, jnp.sum(qi[None, :] * e, axis=1), 0.0)).astype(p_out.dtype)
    return carry

  lax.fori_loop(0, S, body, 0)
  wt_out[b, pl.ds(r0, S), h, :] = (w * exp(g)).astype(wt_out.dtype)


def kern_diag_cols(q_ref, k_ref, w_ref, g_ref, l_out, p_out, wt_out, *, scale, S=16):
  exp = exp_for(q_ref.dtype)   # (the shipped kernels' exp: kernel_math)
  # the same at chunk S by the shipped column loop (intra._diag_columns)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0 = c * S
  q, k, g = (tile(x, b, r0, S, h) for x in (q_ref, k_ref, g_ref))
  I._diag_columns(q, k, g, w_ref, k_ref, g_ref, None, None, l_out, p_out, b, h, r0, 0, scale, S,
                  exp)
  wt_out[b, pl.ds(r0, S), h, :] = (tile(w_ref, b, r0, S, h) * exp(g)).astype(wt_out.dtype)


INTERPRET = jax.default_backend() == "cpu"


def call(body, q, k, w, g, grid, nw, C=64):
  B, T, H, K = k.shape
  cfg = dcfg.DeltaRuleConfig()
  return pl.pallas_call(body, out_shape=(jax.ShapeDtypeStruct((B, H, T, C), jnp.float32),
      jax.ShapeDtypeStruct((B, H, T, C), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16)),
      grid=grid, **launch_params(INTERPRET, nw, cfg))(q, k, w, g)

def med(fn, *a):
  return timing.median_time(fn, *a, warmup=3, repeats=20)

def main(out):
  B, H, K = 4, 16, 128
  res = {}
  for T in (4096, 16384):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, w = (jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(jnp.bfloat16) for kk in ks[:3])
    la = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
    g = jnp.cumsum(la.reshape(B, T // 64, 64, H, K), axis=2).reshape(B, T, H, K)
    g4 = (B, H, T // 64, 4)
    variants = {}
    sc = K ** -0.5
    for nw in (4, 8):
      variants[f"cols_nw{nw}"] = (functools.partial(kern_cols, off=True, scale=sc), g4, nw)
      variants[f"cols_chunk_nw{nw}"] = (functools.partial(kern_cols_chunk, scale=sc), (B, H, T // 64), nw)
    variants["cols_diag_only"] = (functools.partial(kern_cols, off=False, scale=sc), g4, 4)
    g16 = jnp.cumsum(la.reshape(B, T // 16, 16, H, K), axis=2).reshape(B, T, H, K)
    for nw in (2, 4):   # chunk 16 (the shipped chunk): the diagonal tile alone, columns or rows
      variants[f"diag_cols_c16_nw{nw}"] = (functools.partial(kern_diag_cols, scale=sc),
                                           (B, H, T // 16), nw, 16)
      variants[f"diag_rows_c16_nw{nw}"] = (functools.partial(kern_diag_rows, scale=sc),
                                           (B, H, T // 16), nw, 16)
    for name, (body, grid, nw, *cc) in variants.items():
      C = cc[0] if cc else 64
      try:
        f = jax.jit(lambda q, k, w, g, body=body, grid=grid, nw=nw, C=C: call(
            body, q, k, w, g, grid, nw, C))
        ms = med(f, q, k, w, g16 if C == 16 else g)
      except Exception as e:
        ms = f"{type(e).__name__}: {str(e)[:200]}"
      res[f"{name}_T{T}"] = ms
      print(name, T, ms, flush=True)
    # the shipped pair kernel at chunk 64 and the shipped chunk-16 intra stage, for scale
    cfg64 = dcfg.DeltaRuleConfig(max_chunk=64, min_chunk=64, sub_block=16)
    kw = dict(chunk=64, scale=K ** -0.5, interpret=False, cfg=cfg64, cfg_prec="fast")
    f = jax.jit(lambda q, k, w, g: I.pair_rows_forward(q, k, w, g, None, **kw))
    res[f"shipped_pairs_T{T}"] = med(f, q, k, w, g); print("shipped_pairs", T, res[f"shipped_pairs_T{T}"])
    cfg16 = dcfg.DeltaRuleConfig()   # pair rows + WY at chunk 16
    kw16 = dict(chunk=16, scale=K ** -0.5, interpret=False, cfg=cfg16, cfg_prec="fast")
    v = q; h0 = jnp.zeros((B, H, K, K), jnp.float32)
    f = jax.jit(lambda q, k, v, w, g, h0: I.intra_forward(q, k, v, w, g, h0, None, None, **kw16))
    res[f"intra_c16_T{T}"] = med(f, q, k, v, w, g16, h0); print("intra_c16", T, res[f"intra_c16_T{T}"])
  json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
