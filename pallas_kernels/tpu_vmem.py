"""VMEM budgets of the Mosaic-TPU kernels at a given size (the table in docs/tpu.md).

    python -m pallas_kernels.tpu_vmem [--b 4 --t 16384 --h 16 --k 128 --v 128 --dtype bfloat16]

Each kernel's live VMEM = its BlockSpec'd tiles double-buffered + its scratch, counted with
Mosaic's (8|16, 128) tile padding (tpu_common.vmem_bytes). It depends on the block sizes, not
on B, T or H (those only set the grid), which is the point of the tiling.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from pallas_kernels import tpu_common, tuned
from pallas_kernels.delta_rule import tpu_backward, tpu_forward
from pallas_kernels.kdn_gain import tpu as gain_tpu

__all__ = ["budgets", "main"]


def budgets(bsz, t, nh, kd, vd, dtype, gain_block=None, chunk=None):
  """{kernel name: live VMEM bytes} at the default blocks (gain: GainConfig.max_chunk rows,
  delta rule: DeltaRuleConfig.max_chunk) unless given."""
  gain_block = gain_block or tuned.tuned("gain").max_chunk
  chunk = chunk or tuned.tuned("delta_rule").max_chunk
  out = {}
  for diag, name in ((True, "diag"), (False, "iso")):
    out[f"kdn_gain {name} forward (block_t={gain_block})"] = tpu_common.vmem_bytes(
      gain_tpu.forward_blocks(bsz, t, nh, kd, diag, gain_block, dtype)
    )
    out[f"kdn_gain {name} backward (block_t={gain_block})"] = tpu_common.vmem_bytes(
      gain_tpu.backward_blocks(bsz, t, nh, kd, diag, gain_block, dtype)
    )
  out[f"delta_rule forward (chunk={chunk}, segments, saving states)"] = tpu_common.vmem_bytes(
    tpu_forward.forward_blocks(bsz, t, nh, kd, vd, chunk, dtype)
  )
  out[f"delta_rule backward (chunk={chunk}, segments)"] = tpu_common.vmem_bytes(
    tpu_backward.backward_blocks(bsz, t, nh, kd, vd, chunk, dtype)
  )
  return out


def whole_array_bytes(bsz, t, nh, kd, dtype):
  """One [B, T, H, K] operand: what a whole-array pallas_call asks VMEM to hold per input."""
  return bsz * t * nh * kd * jnp.dtype(dtype).itemsize


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--b", type=int, default=4)
  p.add_argument("--t", type=int, default=16384)
  p.add_argument("--h", type=int, default=16)
  p.add_argument("--k", type=int, default=128)
  p.add_argument("--v", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  a = p.parse_args(argv)
  dt = jnp.dtype(a.dtype)
  print(f"B={a.b} T={a.t} H={a.h} K={a.k} V={a.v} {dt.name}\n")
  print("| kernel | live VMEM (KiB) |\n|---|---:|")
  rows = dict(budgets(a.b, a.t, a.h, a.k, a.v, dt))
  for c in (32, 64):
    rows.update(
      {
        k: v
        for k, v in budgets(a.b, a.t, a.h, a.k, a.v, dt, chunk=c).items()
        if k.startswith("delta_rule")
      }
    )
  for name, n in rows.items():
    print(f"| {name} | {n / 1024:.0f} |")
  print(
    f"\nFor scale: one whole [B, T, H, K] {dt.name} operand (what the whole-array kernels "
    f"would need in VMEM per input) is {whole_array_bytes(a.b, a.t, a.h, a.k, dt) / 2**20:.0f}"
    " MiB."
  )


if __name__ == "__main__":
  main()
