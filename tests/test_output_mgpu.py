"""The Mosaic GPU output kernel (pallas_kernels/delta_rule/output_mgpu.py) against output.py's.

On CPU: the kernel itself in jax's GPU interpret mode (SMEM, barriers, TMA copies and wgmma
simulated), the cross-lowering for CUDA (Pallas -> Mosaic GPU dialect, layout inference and the
SMEM budget run in Python, no GPU needed; ptxas and the run do not), and the argument checks.
On a Hopper GPU: the compiled kernel against the compiled Triton one.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.delta_rule import config, output, output_mgpu

C = 64
CFG = dataclasses.replace(config.DEFAULT, max_chunk=C, min_chunk=C)


def _on_hopper():
  try:
    output_mgpu.check_backend(False)
    return True
  except output_mgpu.MosaicGPUUnavailable:
    return False


def _inputs(b, t, h, k, v, dtype, seed=0):
  """q, g (chunk-local log-decay cumsum, <= 0), P (causal, bf16), Delta, states (bf16), h0."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, k)), dtype)
  la = -rng.uniform(0.0, 0.1, (b, t // C, C, h, k))
  g = jnp.asarray(np.cumsum(la, axis=2).reshape(b, t, h, k), jnp.float32)
  p = rng.standard_normal((b, h, t // C, C, C)) * np.tril(np.ones((C, C)))
  p = jnp.asarray(p.reshape(b, h, t, C), jnp.bfloat16)
  delta = jnp.asarray(rng.standard_normal((b, t, h, v)), jnp.bfloat16)
  states = jnp.asarray(rng.standard_normal((b, h, t // C, k, v)), jnp.bfloat16)
  return q, g, p, delta, states, jnp.zeros((b, h, k, v), jnp.float32)


def _einsum_reference(q, g, p, delta, states, scale):
  """O = bf16(Qbar) S_0 + P Delta in fp32, per chunk (bf16 operands, as the kernels' dots)."""
  b, t, h, k = q.shape
  f32 = jnp.float32
  qbar = (scale * q.astype(f32) * jnp.exp(g)).astype(jnp.bfloat16).astype(f32)
  qbar = qbar.reshape(b, t // C, C, h, k)
  o = jnp.einsum("bncht,bhntv->bnchv", qbar, states.astype(f32))
  pm = p.astype(f32).reshape(b, h, t // C, C, C)
  o += jnp.einsum("bhncj,bnjhv->bnchv", pm, delta.astype(f32).reshape(b, t // C, C, h, -1))
  return o.reshape(b, t, h, -1)


def _close(x, ref, tol):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  err = np.max(np.abs(x - ref)) / np.max(np.abs(ref))
  assert err <= tol, f"max error {err:.3g} (relative to max |ref|) > {tol}"


# fp32 data: the same bf16 operands and fp32 accumulation, only the summation order differs;
# bf16 data: the output rounding (1 bf16 ulp = 2^-8 relative) on top.
_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_interpret_matches_triton_kernel(dtype):
  args = _inputs(1, 128, 2, 64, 64, dtype)
  kw = dict(chunk=C, scale=0.125, interpret=True, cfg=CFG, cfg_prec="fast")
  o = output_mgpu.output_forward(*args, None, **kw)
  assert o.shape == args[3].shape and o.dtype == dtype
  _close(o, output.output_forward(*args, None, **kw), _TOL[dtype])
  _close(o, _einsum_reference(*args[:5], 0.125), _TOL[dtype])


def test_interpret_v_blocks_and_narrow_widths():
  """Two V blocks (block_v_parallel=32 < V), B=2 (the batch-head grid axis), K=32; with the
  interpreter's race detection on (jax 0.10.2 runs TMA copies synchronously, so it does not see
  a missing barrier wait there; jax 0.11's interpreter runs them as asynchronous tasks)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params  # pylint: disable=g-import-not-at-top
  args = _inputs(2, 64, 1, 32, 64, jnp.bfloat16, seed=1)
  cfg = dataclasses.replace(CFG, block_v_parallel=32)
  kw = dict(chunk=C, scale=0.3, cfg=cfg, cfg_prec="fast")
  o = output_mgpu.output_forward(*args, None, interpret=params.InterpretGPUParams(
      detect_races=True), **kw)
  assert not interpret_pallas_call.get_races().races_found
  _close(o, output.output_forward(*args, None, interpret=True, **kw), _TOL[jnp.bfloat16])


@pytest.mark.parametrize("kd,vd,dtype", [(128, 128, jnp.bfloat16), (16, 32, jnp.bfloat16),
                                         (128, 128, jnp.float32)])
def test_lowers_for_cuda(kd, vd, dtype):
  """Lowering for the cuda platform on CPU: Pallas -> Mosaic GPU, Warpgroup layout inference,
  the SMEM budget (227 KiB) and the dialect lowering all run here."""
  b, t, h = 4, 4096, 16
  sds = jax.ShapeDtypeStruct
  args = (sds((b, t, h, kd), dtype), sds((b, t, h, kd), jnp.float32),
          sds((b, h, t, C), jnp.bfloat16), sds((b, t, h, vd), jnp.bfloat16),
          sds((b, h, t // C, kd, vd), jnp.bfloat16))
  f = functools.partial(output_mgpu.kernel_call, scale=0.1, block_v=min(128, vd))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_argument_checks():
  args = _inputs(1, 128, 1, 64, 64, jnp.bfloat16)
  kw = dict(chunk=C, scale=0.1, interpret=True, cfg=CFG, cfg_prec="fast")
  cont = jnp.ones((1, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="cont"):
    output_mgpu.output_forward(*args, cont, **kw)
  with pytest.raises(NotImplementedError, match="chunk=16"):
    output_mgpu.output_forward(*args, None, **dict(kw, chunk=16))
  with pytest.raises(NotImplementedError, match="cfg_prec='exact'"):
    output_mgpu.output_forward(*args, None, **dict(kw, cfg_prec="exact"))
  tf32 = dataclasses.replace(CFG, fast_dots="tf32")
  with pytest.raises(NotImplementedError, match="fast_dots='tf32'"):
    output_mgpu.output_forward(*args, None, **dict(kw, cfg=tf32))
  q, g, p, d, s, h0 = args
  with pytest.raises(ValueError, match="pmat must be bfloat16"):
    output_mgpu.output_forward(q, g, p.astype(jnp.float32), d, s, h0, None, **kw)
  with pytest.raises(ValueError, match="states has shape"):
    output_mgpu.output_forward(q, g, p, d, s[:, :, :1], h0, None, **kw)
  with pytest.raises(NotImplementedError, match="V=48"):
    output_mgpu.output_forward(q, g, p, d[..., :48], s[..., :48], h0, None, **kw)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_compiled_refused_on_cpu():
  args = _inputs(1, 128, 1, 64, 64, jnp.bfloat16)
  with pytest.raises(output_mgpu.MosaicGPUUnavailable, match="interpret=True"):
    output_mgpu.output_forward(*args, None, chunk=C, scale=0.1, interpret=False, cfg=CFG,
                               cfg_prec="fast")


@pytest.mark.skipif(not _on_hopper(), reason="the compiled Mosaic GPU kernel needs a Hopper GPU "
                    "(compute capability 9.x, wgmma) with jax's Mosaic GPU backend")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compiled_matches_triton_kernel(dtype):
  args = _inputs(2, 1024, 4, 128, 128, dtype, seed=2)
  kw = dict(chunk=C, scale=0.088, interpret=False, cfg=CFG, cfg_prec="fast")
  o = jax.jit(functools.partial(output_mgpu.output_forward, **kw))(*args, None)
  ref = jax.jit(functools.partial(output.output_forward, **kw))(*args, None)
  _close(o, ref, _TOL[dtype])
  _close(o, _einsum_reference(*args[:5], 0.088), _TOL[dtype])


@pytest.mark.skipif(_on_hopper(), reason="checks the refusal where the kernel cannot run")
def test_benchmark_refuses_without_hopper(tmp_path):
  from experiments import benchmark_output_stage as bench  # pylint: disable=g-import-not-at-top
  bench.FLAGS(["benchmark_output_stage", f"--out={tmp_path}/out.json"])
  try:
    with pytest.raises(SystemExit, match="cannot run the Mosaic GPU row here"):
      bench.main([])
  finally:
    bench.FLAGS.unparse_flags()
  assert not (tmp_path / "out.json").exists()
