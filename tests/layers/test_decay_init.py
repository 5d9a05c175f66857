"""The decay initialisation keys (model config dt_min, dt_max, a_min, a_max; kdn_jax/layers/decay.py):
every mixer's Decay draws its step sizes and rates from them, so the initial time constants
1 / (A dt) move as set, and the defaults give the same parameters as before the keys existed.
Bad values fail through the real CLI (tests/runner/test_cli_values.py)."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from kdn_jax.layers import MIXERS
from kdn_jax.layers.decay import dt_bias_init
from kdn_jax.models.config import ModelConfigError, model_config

LONG = dict(dt_min=1e-5, dt_max=1e-3, a_min=0.5, a_max=2.0)


def _decay(mixer, **keys):
  m = MIXERS[mixer](model_config("tiny", mixer=mixer, **keys), rngs=nnx.Rngs(0))
  dt = np.log1p(np.exp(np.asarray(m.decay.dt_bias[...], np.float64)))  # softplus at f(x) = 0
  A = np.exp(np.asarray(m.decay.A_log[...], np.float64))
  return dt, A


@pytest.mark.parametrize("mixer", ["mamba2", "gla", "kda", "kdn_diag", "gated_deltanet", "gdn2"])
def test_keys_set_the_initial_time_constants(mixer):
  for keys, (dt_lo, dt_hi, a_lo, a_hi) in (
    ({}, (1e-3, 1e-1, 1.0, 16.0)),
    (LONG, (1e-5, 1e-3, 0.5, 2.0)),
  ):
    dt, A = _decay(mixer, **keys)
    assert dt.min() >= dt_lo * (1 - 1e-3) and dt.max() <= dt_hi * (1 + 1e-3), (keys, dt)
    assert A.min() >= a_lo * (1 - 1e-6) and A.max() <= a_hi * (1 + 1e-6), (keys, A)
    if dt.size >= 32:  # per-channel: log-uniform, so both halves of the range are drawn
      assert dt.min() < math.sqrt(dt_lo * dt_hi) < dt.max()
    tau = 1.0 / ((A[:, None] if dt.ndim == 2 else A) * dt)
    assert tau.min() >= 1 / (a_hi * dt_hi) * (1 - 1e-3)
    assert tau.max() <= 1 / (a_lo * dt_lo) * (1 + 1e-3)
  # same draws, a longer range: every time constant is longer
  dt_d, A_d = _decay(mixer)
  dt_l, A_l = _decay(mixer, **LONG)
  assert np.all(dt_l < dt_d) and np.all(A_l <= A_d)


def test_defaults_are_bit_identical():
  """The default keys draw exactly what the fixed ranges drew (floor 1e-4 on dt)."""
  key = jax.random.key(7)
  u = np.asarray(jax.random.uniform(key, (64,), np.float32))
  dt = np.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
  dt = np.maximum(dt, 1e-4).astype(np.float32)
  want = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
  got = np.asarray(dt_bias_init(1e-3, 1e-1)(key, (64,), np.float32))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  a = MIXERS["gla"](model_config("tiny", mixer="gla"), rngs=nnx.Rngs(0))
  b = MIXERS["gla"](
    model_config("tiny", mixer="gla", dt_min=1e-3, dt_max=1e-1, a_min=1.0, a_max=16.0),
    rngs=nnx.Rngs(0),
  )
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
  "keys, key, text",
  [
    (dict(dt_min=0.1, dt_max=0.01), "dt_min", "must be below dt_max"),
    (dict(a_min=-1.0), "a_min", "positive finite"),
    (dict(dt_max=float("inf")), "dt_max", "positive finite"),
    (dict(mamba2_variant="mamba3"), "mamba2_variant", "expected one of"),
  ],
)
def test_bad_values_name_the_key(keys, key, text):
  with pytest.raises(ModelConfigError, match=text) as e:
    model_config("tiny", **keys)
  assert e.value.key == key
