"""pallas_kernels/kernel_math.py: the kernels' exp and softplus for 16-bit data against float64
(the values interpret mode computes; on a GPU the MUFU.EX2 adds ~2^-22 relative), and fp32 data
keeping jnp's."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kernel_math


def test_exp_for_16_bit_data_is_exp2_scaled_and_fp32_keeps_exp():
  x = np.linspace(-30.0, 0.0, 1001).astype(np.float32)
  fast = np.asarray(kernel_math.exp_for(jnp.bfloat16)(jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(fast, np.exp(x.astype(np.float64)), rtol=5e-6)
  assert kernel_math.exp_for(jnp.float32) is jnp.exp
  with pytest.raises(ValueError, match="mode='tf32'"):
    kernel_math.exp_for_mode("tf32")


def test_log1p_series_on_the_unit_interval():
  e = np.concatenate([np.linspace(0.0, 1.0, 100001), np.logspace(-37, 0, 2001)]).astype(np.float32)
  got = np.asarray(kernel_math._log1p_unit_fast(jnp.asarray(e)), np.float64)  # pylint: disable=protected-access
  want = np.log1p(e.astype(np.float64))
  assert got[0] == 0.0 and np.all(np.isfinite(got))
  rel = np.abs(got - want)[want > 0] / want[want > 0]
  assert rel.max() < 5e-7, rel.max()


@pytest.mark.parametrize("dtype,per_unit", [(jnp.bfloat16, 1e-7), (jnp.float32, 0.0)])
def test_softplus_for(dtype, per_unit):
  """Relative error < 5e-7, and for 16-bit data also |x| 1e-7: the rounding of x log2 e in
  exp_for's 2^(x log2 e) (|x| 2^-24 log2 e)."""
  x = np.linspace(-80.0, 60.0, 100001).astype(np.float32)
  got = np.asarray(kernel_math.softplus_for(dtype)(jnp.asarray(x)), np.float64)
  want = np.logaddexp(x.astype(np.float64), 0.0)
  excess = np.abs(got - want) / want - (5e-7 + per_unit * np.abs(x))
  assert excess.max() < 0.0, x[excess.argmax()]
  far = np.asarray(kernel_math.softplus_for(dtype)(jnp.asarray([-1e4, 1e4], jnp.float32)))
  np.testing.assert_array_equal(far, [0.0, 1e4])
