"""Achieved TFLOP/s per device and model FLOPs utilisation (MFU) from tokens/s and the model's FLOPs per
token (kdn_jax.models.flops), against the device's peak from the one table below.

MFU = (model FLOPs per token x tokens/s / devices) / peak FLOP/s of one device, for the run's compute
dtype. The peaks are the vendors' dense (no sparsity) tensor-core numbers. float32 dots at JAX's default
precision run on TF32 tensor cores on these GPUs and as one bfloat16 pass on TPUs, so the float32 column
is the TF32 peak on a GPU and the bfloat16 peak on a TPU. A device kind
missing here (a CPU, an unlisted card) has no peak: its MFU is reported as n/a, never guessed.
"""

from __future__ import annotations

# (substring of jax.Device.device_kind, {dtype: peak TFLOP/s of one device}); the first match wins, so
# the longer names come first
PEAK_TFLOPS = (
  ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
  ("H100", {"bfloat16": 989.4, "float32": 494.7}),  # SXM (HBM3)
  ("H200", {"bfloat16": 989.4, "float32": 494.7}),
  ("A100", {"bfloat16": 312.0, "float32": 156.0}),
  ("TPU v6", {"bfloat16": 918.0, "float32": 918.0}),
  ("TPU v5 lite", {"bfloat16": 197.0, "float32": 197.0}),
  ("TPU v5", {"bfloat16": 459.0, "float32": 459.0}),  # v5p
  ("TPU v4", {"bfloat16": 275.0, "float32": 275.0}),
)


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """Peak dense TFLOP/s of one device of this kind for ``dtype`` ('bfloat16' / 'float32'), or None."""
  for name, peaks in PEAK_TFLOPS:
    if name.lower() in str(device_kind).lower():
      return peaks.get(str(dtype))
  return None


def throughput(
  tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float | None
) -> dict:
  """{'tflops_per_s_per_device', 'mfu' (None without a peak)}."""
  tflops = tokens_per_s * flops_per_token / max(int(num_devices), 1) / 1e12
  return {"tflops_per_s_per_device": tflops, "mfu": None if not peak else tflops / peak}


def describe(t: dict) -> str:
  """' | 0.012 TFLOP/s/device | MFU 3.1%' ('MFU n/a' without a peak)."""
  mfu = "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%"
  return f" | {t['tflops_per_s_per_device']:.3g} TFLOP/s/device | MFU {mfu}"
