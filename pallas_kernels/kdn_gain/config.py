"""Block-size configuration for the Moebius gain kernels: `diag_gain(config=...)` and the other
gain ops; None means the tuned entry for the device (pallas_kernels/tuned.py)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GainConfig:
  # caps the caller's chunk_size (C_g); H200 diag gain fwd, T=4096 (raw-input kernels): 0.46 ms
  # at 128 (1 warp); at 4 warps 0.48 at 64, 0.63 at 256
  max_chunk: int = 128
  # Triton warps per program; H200 diag gain fwd T=4096 (kernels reading the raw inputs): 0.46 ms
  # with 1 warp, 0.50 with 2 (rows are [1, K]: one warp covers them)
  num_warps: int = 1
  # Triton software-pipelining stages of the token loops, forward (reduce, replay) and backward
  # kernels apart. Session 38, H200 diag gain T=16384, one process: forward 1.29 ms at 1 stage,
  # 1.16 at 2 or 3; fwd+bwd with every kernel at 2: 3.48 against 3.45 (the backward lost what the
  # forward gained). Session 44, the forward at 1 / 2 / 3 stages in two processes: 1.21 / 1.21
  # / 1.15 and 1.32 / 1.34 / 1.33 ms, a tie; 1 stays.
  num_stages_fwd: int = 1
  num_stages_bwd: int = 1
  # The isotropic gain's forward replay over per-token scalars (iso_replay.py): the reduce also
  # writes a = mean exp(2 log_alpha) and |k|^2 ([B, T, H] fp32), and the replay reads those
  # instead of the K-wide k and log_alpha rows (at B=4, T=16k, H=16, K=128, bf16: 537 MB of
  # reads out of the gain's 1.09 GB), one program per (batch, chunk) over the heads (padded to
  # a power of two). Session 50, H100, one process (gpu_measurements.sh isoscalar; default first
  # and again last): iso op forward 16k 3.73 ms against 3.91 / 3.92, 4k 1.21 against 1.31 /
  # 1.21; op fwd+bwd 16k 14.71 against 14.80 / 14.80; kdn_iso layer forward 16k 8.61 against
  # 8.73; GPU checks at K=128 and K=16 pass at the default's bounds. On.
  iso_scalar_replay: bool = True
  # The forward reduce renormalises its running 2x2 product after every 2nd token instead of
  # every token (kernel.py, RENORM: exact, the same chunk maps up to a power of two; safe while
  # a token matrix's largest entry stays below 4.6e18; 4 would overflow within the ops' input
  # range). Fewer instructions per token (the max, the exponent trick and 4 multiplies per lane
  # skipped every other token; 154 -> 125 per token, diag, sm_90). Session 50, H100, one process
  # (gpu_measurements.sh renorm; default first and again last): the diag gain forward gains
  # (16k 1.21 ms against 1.25 / 1.26, 4k 0.42 against 0.48 / 0.43) but the diag op does not
  # (forward 16k 4.19 against 4.15 / 4.15, fwd+bwd 16.11 against 16.19 / 16.07), so 1.
  renorm_every: int = 1

  def __post_init__(self):
    if not (
      self.num_warps > 0 and self.num_warps & (self.num_warps - 1) == 0 and self.num_warps <= 32
    ):
      raise ValueError(
        f"GainConfig.num_warps must be a power of two in [1, 32] (Triton warps), "
        f"got {self.num_warps}"
      )
    if type(self.renorm_every) is not int or self.renorm_every not in (1, 2):
      raise ValueError(
        f"GainConfig.renorm_every must be the int 1 or 2 (tokens per "
        f"renormalisation of the reduce's product), got {self.renorm_every!r}"
      )
    for name in ("max_chunk", "num_stages_fwd", "num_stages_bwd"):
      if getattr(self, name) < 1:
        raise ValueError(f"GainConfig.{name} must be >= 1, got {getattr(self, name)}")
