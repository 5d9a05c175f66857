"""A diagonal KDN sweep member's compiled memory stays within 1.3x a KDA member's: the recurrence's
fwd+bwd vmapped over members, as experiments/runner/lr_sweep.py vmaps a sweep, on the chunked
(XLA) path; tiny shapes (the ratio there is the one the Zoology shapes show, docs/decisions.md)."""

import pytest

from experiments.benchmarks import sweep_memory

SHAPE = dict(members=2, batch=2, seq_len=32, heads=2, dim=16, chunk=16)


@pytest.fixture(scope="module")
def per_member():
  return {m: sweep_memory.op_memory(m, **SHAPE)["per_member"] for m in ("kdn_diag", "kda")}


def test_diag_kdn_member_within_1_3x_kda(per_member):
  ratio = per_member["kdn_diag"] / per_member["kda"]
  assert ratio <= 1.3, f"diag KDN needs {ratio:.2f}x KDA's memory per member ({per_member})"


def test_op_memory_names_a_bad_mixer():
  with pytest.raises(ValueError, match="mixer: expected one of"):
    sweep_memory.op_memory("mamba", **SHAPE)
