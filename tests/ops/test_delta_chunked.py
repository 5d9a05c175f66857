"""Pieces of the chunked delta rule: the matmul-only WY inverse."""

import numpy as np
import pytest

from kdn_jax.ops.delta_chunked import unit_lower_inverse


@pytest.mark.parametrize(
  "c,block", [(1, 16), (4, 16), (8, 8), (16, 8), (32, 8), (64, 16), (48, 16), (12, 4)]
)
def test_unit_lower_inverse_matches_numpy(c, block):
  rng = np.random.default_rng(c)
  l_mat = np.tril(rng.standard_normal((3, 2, c, c)) * 0.4, -1)
  got = np.asarray(unit_lower_inverse(l_mat.astype(np.float32), block))
  want = np.linalg.inv(np.eye(c) + l_mat)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert np.all(np.triu(got, 1) == 0)  # exactly lower triangular
