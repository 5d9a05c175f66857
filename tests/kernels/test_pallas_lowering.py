"""The Pallas kernels lower to Triton for a CUDA GPU, checked on CPU with jax's cross-platform
lowering (`.lower(lowering_platforms=("cuda",))`: the kernels' Triton IR is built, nothing is
compiled or run). Interpret mode proves the kernels' values, not that Triton's lowering accepts
them: a `c % stride` in a loop body ran exactly in interpret mode and failed to lower on the
H200 (jnp's remainder became an i32 % i1 Triton op; docs/decisions.md). CI has no GPU; this catches that class
of failure before a device call does.

On CPU the kernels would pick interpret mode, no compiler params and HIGHEST dots; the fixture
sets common.kernel_backend to "gpu", so they choose what they choose on a GPU (compiled, Triton
params, 3xTF32 for 'exact').
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import ops_cases
import pytest
from flax import nnx

from kdn_jax import ops
from kdn_jax.layers.registry import MIXERS
from kdn_jax.models.config import model_config
from kdn_jax.ops import nonfinite
from pallas_kernels import KernelConfigs, common
from pallas_kernels.delta_rule import config as dr_config


@pytest.fixture
def as_on_gpu(monkeypatch):
  monkeypatch.setattr(common, "kernel_backend", lambda: "gpu")


def _lower_for_cuda(fn, *args):
  """The MLIR text of fn(*args) lowered for CUDA; raises where a kernel does not lower."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _triton_kernels(text):
  """Names of the Triton kernels (pallas_call names) in a lowering's text."""
  assert "@__gpu$xla.gpu.triton" in text, "no Triton custom call in the lowering"
  return set(re.findall(r"(?:delta_rule|kdn_gain|causal_conv1d|gated_norm)_[a-z_]+", text))


def _op_inputs(dtype, t=80, d=64):
  seg = (jnp.arange(t)[None, :] >= 37).astype(jnp.int32)
  return ops_cases.random_kdn_inputs(dtype, t=t, d=d) + (seg,)


@pytest.mark.parametrize("variant,d", [({}, 64), (dict(cumsum_block=1), 64), ({}, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kdn_op_lowers_for_cuda(as_on_gpu, variant, d, dtype):
  """diag KDN forward and backward (gain kernels, pair, WY, state pass, output, the backward
  kernels), with a segment reset, with the reverse cumsum's loads blocked and plain, and at
  K = V = 256 (key tiles, the wide V blocks); in bf16 the gates too (the kernels store every
  gradient in its input's dtype)."""
  q, k, v, la, om, r, seg = _op_inputs(dtype, d=d)
  la, om, r = (x.astype(dtype) for x in (la, om, r))

  kc = KernelConfigs(delta_rule=dr_config.DeltaRuleConfig(**variant))

  def loss(q, k, v, la, om, r):
    o, _ = ops.diag_kdn(
      q, k, v, la, om, r, segment_ids=seg, impl="pallas", chunk_size=64, kernel_config=kc
    )
    return jnp.sum(o.astype(jnp.float32))

  text = _lower_for_cuda(jax.grad(loss, argnums=tuple(range(6))), q, k, v, la, om, r)
  expected = {
    "kdn_gain_reduce",
    "kdn_gain_replay",
    "kdn_gain_bwd_reduce",
    "kdn_gain_bwd_replay",
    "delta_rule_wy",
    "delta_rule_state_pass",
    "delta_rule_output",
    "delta_rule_recur_bwd",
    "delta_rule_bwd_partials",
    "delta_rule_intra_bwd_tokens",
    "delta_rule_reverse_cumsum",
    "delta_rule_pair_token_loop",
  }
  kernels = _triton_kernels(text)
  assert expected <= kernels, expected - kernels


@pytest.mark.parametrize("d", [64, 256])
def test_scalar_write_lowers_for_cuda(as_on_gpu, d):
  """KDA with beta [B, T, H] (the write beta k formed in the pair kernel and the intra backward,
  which also sums beta's gradient, over the key tiles at K = 256), bf16, a reset: forward and
  backward lower, and beta reaches the kernels as [B, T, H] (no [B, T, H, K] write made in
  XLA)."""
  q, k, v, la, _, r, seg = _op_inputs(jnp.bfloat16, d=d)
  beta = jax.nn.sigmoid(r).astype(jnp.bfloat16)

  def loss(q, k, v, la, beta):
    o, _ = ops.kda(q, k, v, la, beta, segment_ids=seg, impl="pallas", chunk_size=64)
    return jnp.sum(o.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(5))))(q, k, v, la, beta)
  text = _lower_for_cuda(jax.grad(loss, argnums=tuple(range(5))), q, k, v, la, beta)
  kernels = _triton_kernels(text)
  assert {"delta_rule_pair_token_loop", "delta_rule_intra_bwd_tokens"} <= kernels, kernels
  # beta is never broadcast against k ([B, T, H, 1]) to make a [B, T, H, K] write in XLA
  assert not re.search(r"bf16\[1,80,2,1\]", str(jaxpr)), "beta broadcast to [B, T, H, 1]"


@pytest.mark.parametrize("segments", [False, True])
def test_forward_only_call_lowers(as_on_gpu, segments):
  """A call not differentiated: the pair kernel writes Kbar, Qbar and g_last alone (its masked
  last-row store), read by the WY kernel and the state pass with the output fused (no segments)
  or the state pass and the output kernel; lowers for CUDA, bf16."""
  from pallas_kernels import delta_rule  # pylint: disable=g-import-not-at-top

  q, k, v, la, _, _, seg = _op_inputs(jnp.bfloat16)
  h0 = jnp.zeros((1, 2, 64, 64), jnp.float32)
  fwd = lambda q, k, v: delta_rule(q, k, v, la, k, 0.125, h0, seg if segments else None)[0]
  kernels = _triton_kernels(_lower_for_cuda(fwd, q, k, v))
  want = {"delta_rule_pair_token_loop", "delta_rule_wy"} | (
    {"delta_rule_state_pass", "delta_rule_output"} if segments else {"delta_rule_state_output"}
  )
  assert kernels == want, kernels


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("differentiated", [False, True])
def test_fused_output_picks_the_kernels_and_lowers(as_on_gpu, segments, differentiated):
  """The serial pass forms O itself (delta_rule_state_output, no output kernel) in calls that
  are not differentiated and have no segment_ids; the other calls run the state pass and the
  output kernel. Each combination lowers for CUDA, bf16 data."""
  from pallas_kernels import delta_rule  # pylint: disable=g-import-not-at-top

  q, k, v, la, _, _, seg = _op_inputs(jnp.bfloat16)
  seg = seg if segments else None
  h0 = jnp.zeros((1, 2, 64, 64), jnp.float32)

  def fwd(q, k, v):
    return delta_rule(q, k, v, la, k, 0.125, h0, seg, chunk_size=16)[0]

  fn = (
    jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    if differentiated
    else fwd
  )
  kernels = _triton_kernels(_lower_for_cuda(fn, q, k, v))
  fused = not differentiated and not segments
  if fused:
    assert "delta_rule_state_output" in kernels and not kernels & {
      "delta_rule_state_pass",
      "delta_rule_output",
    }, kernels
  else:
    assert {"delta_rule_state_pass", "delta_rule_output"} <= kernels, kernels
    assert "delta_rule_state_output" not in kernels, kernels


@pytest.mark.parametrize(
  "mixer,options",
  [("kdn_diag", "default"), ("kdn_iso", "default"), ("kdn_diag", "plain_loops")],
)
def test_kdn_layer_lowers_for_cuda(as_on_gpu, monkeypatch, mixer, options):
  """A whole KDN layer on the pallas path, fwd+bwd: the fused gate front-end, the short convs and
  the gated norm kernels as well as the memory update. 'plain_loops': the conv and reverse
  cumsum row loops as plain loops (not their default blocks of 8)."""
  kc = None
  if options == "plain_loops":
    from pallas_kernels.causal_conv1d import config as conv_config  # pylint: disable=g-import-not-at-top

    kc = KernelConfigs(
      conv=conv_config.ConvConfig(load_block=1),
      delta_rule=dr_config.DeltaRuleConfig(cumsum_block=1),
    )
  cfg = model_config(
    "tiny",
    d_model=128,
    num_heads=2,
    head_dim=64,
    mixer=mixer,
    impl="pallas",
    chunk_size=16,
    dtype="bfloat16",
    param_dtype="float32",
    mlp_hidden=1,
  )
  layer = MIXERS[mixer](cfg, rngs=nnx.Rngs(0), kernel_config=kc)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 48, 128)), jnp.bfloat16)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32))

  kernels = _triton_kernels(_lower_for_cuda(jax.grad(loss, argnums=(0, 1)), params, x))
  assert {
    "causal_conv1d_fwd",
    "causal_conv1d_bwd",
    "gated_norm_fwd",
    "gated_norm_bwd",
    "kdn_gain_reduce",
    "kdn_gain_bwd_replay",
    "delta_rule_output",
    "delta_rule_intra_bwd_tokens",
    "delta_rule_reverse_cumsum",
  } <= kernels
  assert "delta_rule_pair_token_loop" in kernels, kernels


def test_gain_stages_reach_their_kernels(as_on_gpu, monkeypatch):
  """GainConfig.num_stages_fwd / num_stages_bwd: the Triton pipelining stages of the gain's
  forward (reduce, replay) and backward kernels, each set apart."""
  from pallas_kernels.kdn_gain import config as gain_config  # pylint: disable=g-import-not-at-top

  kc = KernelConfigs(gain=gain_config.GainConfig(num_stages_fwd=3, num_stages_bwd=2))
  q, k, v, la, om, r, _ = _op_inputs(jnp.float32)

  def loss(k, la):
    o = ops.diag_kdn(q, k, v, la, om, r, impl="pallas", chunk_size=16, kernel_config=kc)[0]
    return jnp.sum(o)

  stages = {}
  for line in _lower_for_cuda(jax.grad(loss, argnums=(0, 1)), k, la).splitlines():
    name = re.search(r"kdn_gain_(?:bwd_)?(?:reduce|replay)", line)
    if name and "xla.gpu.triton" in line:
      stages[name.group(0)] = int(re.search(r"num_stages = (\d+)", line).group(1))
  assert stages == {
    "kdn_gain_reduce": 3,
    "kdn_gain_replay": 3,
    "kdn_gain_bwd_reduce": 2,
    "kdn_gain_bwd_replay": 2,
  }, stages


@pytest.mark.parametrize("diag", [True, False])
def test_backward_kernels_store_gradients_in_the_inputs_dtypes(as_on_gpu, monkeypatch, diag):
  """bf16 data, KDN op fwd+bwd lowered for CUDA: the token kernel stores dq, dk, the partials
  kernel dv, the gain's reverse replay dk and the gates' gradients in bf16 (no fp32 copy and
  cast pass)."""
  from pallas_kernels.delta_rule import backward as dbackward  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kdn_gain import kernel as gain_kernel  # pylint: disable=g-import-not-at-top

  seen = {}

  def spy(module, name):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
      out = real(*args, **kwargs)
      seen[name] = [jnp.dtype(x.dtype).name for x in jax.tree.leaves(out)]
      return out

    monkeypatch.setattr(module, name, wrapped)

  for module, name in (
    (dbackward, "intra_backward_tokens"),
    (dbackward, "bwd_partials"),
    (gain_kernel, "gain_backward"),
  ):
    spy(module, name)
  q, k, v, la, om, r, _ = _op_inputs(jnp.bfloat16)
  la, om, r = (x.astype(jnp.bfloat16) for x in (la, om if diag else om[..., 0], r))
  fn = ops.diag_kdn if diag else ops.iso_kdn

  def loss(q, k, v, la, om, r):
    return jnp.sum(fn(q, k, v, la, om, r, impl="pallas", chunk_size=16)[0].astype(jnp.float32))

  _lower_for_cuda(jax.grad(loss, argnums=tuple(range(6))), q, k, v, la, om, r)
  bf16 = "bfloat16"
  assert seen["intra_backward_tokens"][:2] == [bf16, bf16]
  assert seen["bwd_partials"][0] == bf16  # dv (no segments)
  assert seen["gain_backward"][:4] == [bf16] * 4, seen  # dk, d log_alpha, d omega, d r


@pytest.mark.parametrize(
  "layer,heads,grad",
  [(False, 2, True), (False, 3, False), (True, 2, True), (True, 2, False)],
)
def test_iso_scalar_replay_lowers_for_cuda(as_on_gpu, layer, heads, grad):
  """The iso replay over per-token scalars: the iso KDN op (segments; 3 heads: the row padded to
  4) and the kdn_iso layer (the fused gate front-end), forward-only and fwd+bwd, lower for CUDA
  with the scalar replay in place of the lane replay, and the backward's kernels unchanged."""
  kc = None
  if layer:
    cfg = model_config(
      "tiny",
      d_model=64,
      num_heads=heads,
      head_dim=32,
      mixer="kdn_iso",
      impl="pallas",
      chunk_size=16,
      dtype="bfloat16",
      param_dtype="float32",
      mlp_hidden=1,
    )
    mixer = MIXERS["kdn_iso"](cfg, rngs=nnx.Rngs(0), kernel_config=kc)
    graphdef, params, rest = nnx.split(mixer, nnx.Param, ...)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 40, 64)), jnp.bfloat16)

    def loss(params, x):
      return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32))

    args = (params, x)
  else:
    q, k, v, la, om, r = ops_cases.random_kdn_inputs(jnp.bfloat16, h=heads)
    seg = (jnp.arange(q.shape[1])[None, :] >= 37).astype(jnp.int32)

    def loss(k, la, om, r):
      return jnp.sum(
        ops.iso_kdn(
          q,
          k,
          v,
          la,
          om[..., 0],
          r,
          impl="pallas",
          chunk_size=16,
          segment_ids=seg,
          kernel_config=kc,
        )[0].astype(jnp.float32)
      )

    args = (k, la, om, r)
  fn = jax.grad(loss, argnums=tuple(range(len(args)))) if grad else loss
  kernels = _triton_kernels(_lower_for_cuda(fn, *args))
  replays = {"kdn_gain_iso_replay", "kdn_gain_replay"}
  used = "kdn_gain_iso_replay"
  assert {"kdn_gain_reduce", used} <= kernels and not (replays - {used}) & kernels, kernels
  assert ({"kdn_gain_bwd_reduce", "kdn_gain_bwd_replay"} <= kernels) == grad, kernels


@pytest.mark.parametrize("kd,vd", [(128, 384), (48, 320)])
def test_any_width_lowers_for_cuda(as_on_gpu, kd, vd):
  """The diag (and at K = 128 the iso) KDN op fwd+bwd, bf16 with a reset, at K = 128, V = 384
  (column tiles of the widest kernel width, 256, and 128) and at K = 48, V = 320 (ops/widths.py:
  K padded to 64, V in tiles of 256 and 64): every kernel lowers (Triton takes power-of-two
  arrays only), the delta rule once per V tile."""
  b, t, h = 1, 40, 2
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  q, k = (jax.random.normal(x, (b, t, h, kd)).astype(jnp.bfloat16) for x in ks[:2])
  v = jax.random.normal(ks[2], (b, t, h, vd)).astype(jnp.bfloat16)
  la = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, kd)))
  om = jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, kd)))
  r = 1.0 + jax.nn.softplus(jax.random.normal(ks[5], (b, t, h)))
  seg = (jnp.arange(t)[None, :] >= 23).astype(jnp.int32)
  for fn, omega in ((ops.diag_kdn, om), (ops.iso_kdn, om[..., 0]))[: 2 if kd == 128 else 1]:

    def loss(q, k, v, la, om, r, fn=fn):
      o, _ = fn(q, k, v, la, om, r, segment_ids=seg, impl="pallas", chunk_size=16)
      return jnp.sum(o.astype(jnp.float32))

    text = _lower_for_cuda(jax.grad(loss, argnums=tuple(range(6))), q, k, v, la, omega, r)
    kernels = _triton_kernels(text)
    assert {
      "kdn_gain_reduce",
      "kdn_gain_bwd_replay",
      "delta_rule_wy",
      "delta_rule_state_pass",
      "delta_rule_output",
      "delta_rule_recur_bwd",
      "delta_rule_intra_bwd_tokens",
    } <= kernels
    tiles = -(-vd // max(common.CHUNK_WIDTHS))
    # (one forward state pass per tile, counted with the guard that runs the op once:
    # kdn_jax/ops/nonfinite.py's default also lowers the fallback's)
    with nonfinite.scheme("inputs"):
      text = _lower_for_cuda(jax.grad(loss, argnums=tuple(range(6))), q, k, v, la, omega, r)
    assert len(re.findall(r'name = "delta_rule_state_pass', text)) == tiles, fn.__name__


def test_official_mamba2_layer_lowers_for_cuda(as_on_gpu):
  """mamba_ssm's Mamba2 block (mamba2_variant='official') fwd+bwd under impl='pallas', bf16:
  d_state 128 by headdim 64 with one B/C head shared by the value heads reaches the delta-rule
  kernels and lowers."""
  cfg = model_config(
    "tiny",
    mixer="mamba2",
    mamba2_variant="official",
    impl="pallas",
    chunk_size=16,
    dtype="bfloat16",
    param_dtype="float32",
  )
  layer = MIXERS["mamba2"](cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 48, 64)), jnp.bfloat16)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0].astype(jnp.float32))

  kernels = _triton_kernels(_lower_for_cuda(jax.grad(loss, argnums=(0, 1)), params, x))
  assert {"delta_rule_output", "delta_rule_intra_bwd_tokens"} <= kernels, kernels
