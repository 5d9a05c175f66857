"""KDN gain (diagonal and isotropic) as Pallas kernels with a custom VJP.

chunk.py       the ops and their custom VJP (diag and iso, plain and with the gate front-end)
chunk_fwd.py   the forward per (batch, head) shard;  chunk_bwd.py  the backward
inputs.py      shape checks, padding to whole chunks, the chunk length
kernel.py      the Pallas kernels (Triton / generic), over lanes (K diag, 1 iso);
               iso_replay.py, moebius.py their pieces
tpu.py         the Mosaic-TPU kernels
"""

from pallas_kernels.kdn_gain.chunk import diag_gain, diag_gain_fused, iso_gain, iso_gain_fused
from pallas_kernels.kdn_gain.inputs import PAD_PREACT, check_gate, gain_chunk, kernel_inputs

__all__ = [
  "diag_gain",
  "iso_gain",
  "diag_gain_fused",
  "iso_gain_fused",
  "PAD_PREACT",
  "check_gate",
  "gain_chunk",
  "kernel_inputs",
]
