"""Checksums of a checkpoint's arrays, computed where the arrays live (sharded, on device).

orbax stores arrays compressed and reads back whatever bytes it finds: a flipped bit or a few
overwritten bytes can decode to other values without an error (seen: Adam's second moment
restored with NaN and 3e38 entries). Each array's checksum is saved in the checkpoint's JSON
record and compared after a restore.

The checksum of an array is two uint32 sums over its raw bits read as 32-bit words w_i (16- and
8-bit values widened, 64-bit ones split): sum_i w_i and sum_i (2i + 1) w_i, both mod 2^32. Sums
mod 2^32 are exact in any order, so every sharding and device count gives the same numbers, and
one flipped bit changes the first sum by +-2^b, never 0 mod 2^32; the weighted sum catches
swapped words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "sum32x2-v1"


def _words(x):
  """The array's raw bits as a flat uint32 vector."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  size = jnp.dtype(x.dtype).itemsize
  if size in (1, 2):
    narrow = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32).ravel()
  return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()  # 8 bytes: [..., 2] words


def _sums(x):
  w = _words(x)
  weight = jnp.arange(w.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


@functools.lru_cache(maxsize=8)
def _jitted(out_sharding):
  return jax.jit(lambda flat: {k: _sums(v) for k, v in flat.items()}, out_shardings=out_sharding)


def checksums(flat: dict) -> dict:
  """{key: [sum, weighted sum]} (Python ints) of a flat dict of arrays (numpy or jax, any sharding)."""
  if not flat:
    return {}
  mesh = next(
    (
      v.sharding.mesh
      for v in flat.values()
      if isinstance(getattr(v, "sharding", None), jax.sharding.NamedSharding)
    ),
    None,
  )
  # replicated results: every process of a multi-host run can read them
  out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sums = jax.device_get(_jitted(out)(flat))
  return {k: [int(s) for s in np.asarray(v)] for k, v in sums.items()}


def mismatches(saved: dict, flat: dict) -> list[str]:
  """Keys of ``flat`` whose checksum differs from ``saved`` (keys ``saved`` lacks are not checked)."""
  common = {k: v for k, v in flat.items() if k in saved}
  now = checksums(common)
  return [k for k in common if [int(s) for s in saved[k]] != now[k]]
