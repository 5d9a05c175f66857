"""Model FLOPs per token equal a count by hand for a tiny model with every kind of token mixing (a
delta-rule recurrence, a plain linear recurrence, full and sliding-window attention), tied and untied;
TFLOP/s and MFU follow from tokens/s and the peak table (kdn_jax/models/flops.py has the count's proof)."""

from __future__ import annotations

import math

import jax
import pytest
from flax import nnx
from runner_helpers import tiny_config

from experiments.runner import mfu
from kdn_jax.models import flops
from kdn_jax.models.lm import LanguageModel

T = 16  # the training window


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_is_the_hand_count(tied):
  c = tiny_config(layer_pattern="kdn_diag,attention,gla,swa").model
  c.num_layers, c.tie_embeddings = 4, tied
  vocab, d, H, dh, w = 32, 32, 2, 8, 8  # tiny_config's sizes: K = V = head_dim
  model = LanguageModel(c, rngs=nnx.Rngs(0))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  # every weight a token meets: all parameters but the input lookup table (tied: the table is also the
  # output projection, so it stays)
  n = sum(math.prod(p.shape) for p in params) - (0 if tied else vocab * d)
  assert model.init_states(1)[0]["memory"].shape == (1, H, dh, dh)
  delta = 3 * 2 * H * dh * dh  # read q^T S, read S^T k, write k u^T
  linear = 2 * 2 * H * dh * dh  # read q^T S, write k v^T
  full = 2 * 2 * H * dh * sum(range(1, T + 1)) / T  # q k^T and p v over t positions
  swa = 2 * 2 * H * dh * sum(min(t, w) for t in range(1, T + 1)) / T
  forward = 2 * n + delta + full + linear + swa
  got = flops.flops_per_token(c, T)
  assert got["dense_params"] == n
  assert got["forward"] == pytest.approx(forward, rel=1e-12)
  assert got["train"] == pytest.approx(3 * forward, rel=1e-12)


def test_mfu_against_the_peak_table():
  assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
  assert mfu.peak_tflops("NVIDIA H100 PCIe", "float32") == 378.0
  assert mfu.peak_tflops("cpu", "float32") is None
  t = mfu.throughput(2e5, 3e9, 2, 989.4)  # tokens/s, FLOPs per token, devices, peak
  assert t["tflops_per_s_per_device"] == pytest.approx(300.0)
  assert t["mfu"] == pytest.approx(300.0 / 989.4)
  assert mfu.describe(t) == " | 300 TFLOP/s/device | MFU 30.3%"
  assert mfu.describe(mfu.throughput(2e5, 3e9, 2, None)).endswith("| MFU n/a")
