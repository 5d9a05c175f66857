"""experiments/benchmarks/kernel_dev/kernel_sass.py's CPU half (the Triton IR taken from a CUDA lowering; the SASS
parsing), and the kernels' exp choice (pallas_kernels/kernel_math.py) as it reaches Triton: the
triton package that compiles the IR to SASS is not a dependency, so CI checks the IR."""

import jax
import jax.numpy as jnp
import ops_cases
import pytest
from flax import nnx

from experiments.benchmarks.kernel_dev import kernel_sass
from kdn_jax import ops
from kdn_jax.layers.registry import MIXERS
from kdn_jax.models.config import model_config
from pallas_kernels import tuned


def _kdn_inputs(dtype, seed, t=48):
  """diag KDN op inputs (q, k, v, log_alpha, omega, r), all in dtype, B=1 H=2 K=V=16."""
  return ops_cases.random_kdn_inputs(dtype, seed, t=t, d=16, gate_dtype=dtype)


def _kdn_forward_modules(dtype):
  fwd = lambda *a: ops.diag_kdn(*a, impl="pallas", chunk_size=64)[0]
  return {m["name"]: m for m in kernel_sass.triton_modules(fwd, *_kdn_inputs(dtype, 0))}


def test_triton_modules_of_the_kdn_forward_with_their_launch_parameters():
  mods = _kdn_forward_modules(jnp.bfloat16)
  cfg = tuned.tuned("delta_rule")
  # (the pair kernel forms g: no forward cumsum kernel)
  assert {
    "kdn_gain_reduce",
    "kdn_gain_replay",
    "delta_rule_pair_token_loop",
    "delta_rule_wy",
    "delta_rule_state_output",
  } <= set(mods)
  assert "delta_rule_cumsum" not in mods
  assert mods["delta_rule_pair_token_loop"]["num_warps"] == cfg.num_warps_pairs
  assert mods["delta_rule_wy"]["num_warps"] == cfg.num_warps_intra
  assert mods["delta_rule_pair_token_loop"]["num_stages"] == cfg.num_stages
  assert all("tt.func" in m["ttir"] for m in mods.values())
  # HBM bytes: the gain reduce's operands (k, log_alpha, omega [1, 64, 2, 16] bf16 and r
  # [1, 64, 2], T padded to its chunk 64; mu [2], reset [1, 64] int32, p0 [1, 2, 16] fp32)
  # and its result (the chunk's 2 x 2 maps [1, 2, 1, 4, 16] fp32)
  lanes = 64 * 2 * 16
  assert mods["kdn_gain_reduce"]["hbm_bytes"] == (
    3 * lanes * 2 + 64 * 2 * 2 + 2 * 4 + 64 * 4 + 2 * 16 * 4 + 2 * 4 * 16 * 4
  )


def _math_calls(mods):
  """{kernel name: the libdevice exp / log1p functions its Triton IR calls}."""
  names = ("__nv_expf", "__nv_exp2f", "__nv_log1pf")
  return {m["name"]: {n for n in names if n in m["ttir"]} for m in mods}


def _kdn_grad_modules(dtype, seg):
  args = _kdn_inputs(dtype, 1)
  ids = (jnp.arange(args[0].shape[1])[None, :] >= 21).astype(jnp.int32) if seg else None

  def loss(*a):
    return jnp.sum(
      ops.diag_kdn(*a, segment_ids=ids, impl="pallas", chunk_size=64)[0].astype(jnp.float32)
    )

  return kernel_sass.triton_modules(jax.grad(loss, argnums=tuple(range(6))), *args)


@pytest.mark.parametrize("dtype,seg", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_kernels_exp_follows_the_data_dtype(dtype, seg):
  """diag KDN fwd+bwd, every kernel that takes an exp (gains, the delta rule's forward and
  backward; the WY and output kernels read Kbar and Qbar and take none): 16-bit data call
  libdevice's exp2f (one MUFU.EX2) and never expf; fp32 data the reverse."""
  calls = _math_calls(_kdn_grad_modules(dtype, seg))
  assert len(calls) >= 10
  wanted, banned = (
    ("__nv_exp2f", "__nv_expf") if dtype == jnp.bfloat16 else ("__nv_expf", "__nv_exp2f")
  )
  assert all(banned not in used for used in calls.values()), calls
  assert sum(wanted in used for used in calls.values()) >= 8, calls


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_delta_rule_exp_follows_its_precision_even_with_a_traced_scale(dtype):
  """The delta-rule kernels take their exp from the call's precision: 'fast' (explicit, or bf16
  data), also where a traced scale folds q into fp32 before the kernels (one choice for all)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top

  ks = jax.random.split(jax.random.PRNGKey(2), 5)
  b, t, h, d = 1, 32, 2, 16
  q, k, v, w = (jax.random.normal(x, (b, t, h, d)).astype(dtype) for x in ks[:4])
  la = -jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d)))
  s0 = jnp.zeros((b, h, d, d), jnp.float32)

  def loss(q, k, v, w, la, scale):
    o, _ = pk.delta_rule(q, k, v, la, w, scale, s0, precision="fast")
    return jnp.sum(o.astype(jnp.float32))

  calls = _math_calls(
    kernel_sass.triton_modules(
      jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, k, v, w, la, jnp.float32(0.25)
    )
  )
  used = set().union(*calls.values())
  assert "__nv_exp2f" in used and "__nv_expf" not in used, calls


def test_fused_layer_glue_uses_the_16_bit_math():
  """The kdn_diag layer in bf16 on the pallas path, fwd+bwd: the fused gate front-end's softplus
  has no libdevice log1pf, and no kernel (conv, norm, gains, delta rule) calls expf."""
  cfg = model_config(
    "tiny",
    d_model=64,
    num_heads=2,
    head_dim=32,
    mixer="kdn_diag",
    impl="pallas",
    chunk_size=16,
    dtype="bfloat16",
    param_dtype="float32",
    mlp_hidden=1,
  )
  layer = MIXERS["kdn_diag"](cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = jax.random.normal(jax.random.PRNGKey(3), (1, 32, 64)).astype(jnp.bfloat16)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32))

  calls = _math_calls(kernel_sass.triton_modules(jax.grad(loss, argnums=(0, 1)), params, x))
  assert {"causal_conv1d_fwd", "gated_norm_bwd", "kdn_gain_reduce"} <= set(calls)
  assert all(not used & {"__nv_expf", "__nv_log1pf"} for used in calls.values()), calls
  assert "__nv_exp2f" in calls["kdn_gain_reduce"] and "__nv_exp2f" in calls["gated_norm_fwd"]


def test_comparison_lists_kernels_of_either_side():
  row = lambda name, regs: dict(
    name=name, registers=regs, instructions=100, loops=[dict(instructions=10, ops={})]
  )
  table = kernel_sass.format_comparison(
    [row("a", 40), row("new_only", 8)], [row("a", 48), row("gone", 16)]
  )
  assert "| a | 48 -> 40 | 100 -> 100 | 10 -> 10 |" in table
  assert "| new_only | - -> 8 |" in table and "| gone | 16 -> - |" in table
  # the report's table: 6 GB at 3 TB/s is 2 ms
  full = dict(row("a", 40), num_warps=1, num_stages=1, local_bytes=0, shared_bytes=0, hbm_mb=6000.0)
  assert kernel_sass.format_table([full]).endswith("| 10 | 6000.0 | 2.000 |")


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
.L_x_1:
        /*0020*/                   MUFU.EX2 R5, R5 ;
        /*0030*/              @!P0 FADD R6, R5, R6 ;
        /*0040*/              @!P1 BRA `(.L_x_1) ;
        /*0050*/                   SHFL.BFLY PT, R2, R3, 0x10, 0x1f ;
        /*0060*/                   BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def test_sass_loops_reports_the_innermost_loops():
  n, loops = kernel_sass.sass_loops(_SASS)
  assert n == 9
  assert loops == [dict(instructions=3, ops={"BRA": 1, "FADD": 1, "MUFU": 1})]
  assert "3 (MUFU 1)" in kernel_sass.format_table(
    [
      dict(
        name="k",
        num_warps=1,
        num_stages=1,
        registers=8,
        local_bytes=0,
        shared_bytes=0,
        instructions=n,
        loops=loops,
      )
    ]
  )
