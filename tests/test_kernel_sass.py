"""experiments/kernel_sass.py's CPU half (the Triton IR taken from a CUDA lowering; the SASS
parsing), and the kernels' exp choice (pallas_kernels/kernel_math.py) as it reaches Triton: the
triton package that compiles the IR to SASS is not a dependency, so CI checks the IR."""
import jax
import jax.numpy as jnp
import pytest

from experiments import kernel_sass
from kdn_jax import ops
from pallas_kernels.delta_rule import config as dr_config


def _kdn_forward_modules(dtype):
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  b, t, h, d = 1, 48, 2, 16
  q, k, v = (jax.random.normal(x, (b, t, h, d)).astype(dtype) for x in ks[:3])
  la = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, d))).astype(dtype)
  om = jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, d))).astype(dtype)
  r = (1.0 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))).astype(dtype)
  fwd = lambda *a: ops.diag_kdn(*a, impl="pallas", chunk_size=64)[0]
  return {m["name"]: m for m in kernel_sass.triton_modules(fwd, q, k, v, la, om, r)}


def test_triton_modules_of_the_kdn_forward_with_their_launch_parameters():
  mods = _kdn_forward_modules(jnp.bfloat16)
  cfg = dr_config.DEFAULT
  assert {"kdn_gain_reduce", "kdn_gain_replay", "delta_rule_cumsum", "delta_rule_pair_token_loop",
          "delta_rule_wy", "delta_rule_state_output"} <= set(mods)
  assert mods["delta_rule_pair_token_loop"]["num_warps"] == cfg.num_warps_pairs
  assert mods["delta_rule_wy"]["num_warps"] == cfg.num_warps_intra
  assert mods["delta_rule_pair_token_loop"]["num_stages"] == cfg.num_stages
  assert all("tt.func" in m["ttir"] for m in mods.values())


@pytest.mark.parametrize("dtype,fast", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_kernels_exp_is_one_exp2_for_16_bit_data(dtype, fast):
  """bf16 data: every exp of the forward's kernels is libdevice's exp2f (one MUFU.EX2); fp32
  data keep expf (about 1 ulp)."""
  mods = _kdn_forward_modules(dtype)
  for name in ("kdn_gain_reduce", "delta_rule_pair_token_loop", "delta_rule_wy",
               "delta_rule_state_output"):
    ir = mods[name]["ttir"]
    assert ("__nv_exp2f" in ir) == fast, name
    assert ("__nv_expf" in ir) == (not fast), name


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
  assert "3 (MUFU 1)" in kernel_sass.format_table([dict(
      name="k", num_warps=1, num_stages=1, registers=8, local_bytes=0, shared_bytes=0,
      instructions=n, loops=loops)])
