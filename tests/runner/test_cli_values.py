"""Values that make no sense, through the real command line: exit code 2 and one 'Config error:' line
naming the key (or flag, file, workdir) and what was expected, before anything is built.

The command lines run as forked children of one process that imported experiments.train once
(tests/train_cli_batch.py: each child parses its own argv with the module's absl app); two of them
also run as fresh `python -m experiments.train` processes, which must give the same result."""

from __future__ import annotations

import json
import os
import re
import socket

import numpy as np
import pytest
from runner_helpers import ROOT, run_one_device

SMOKE = "--config=configs/mqar.py:smoke"

# (id, extra argv after SMOKE (None: argv replaces SMOKE), pattern of the one stderr line)
CASES = [
  ("eval_every", ["--config.train.eval_every=-1"], r"config\.train\.eval_every: must be >= 0"),
  (
    "clip_norm_nan",
    ["--config.optim.clip_norm=nan"],
    r"config\.optim\.clip_norm: must be a finite number, got nan",
  ),
  (
    "num_kv_pairs",
    ["--config.data.mqar.num_kv_pairs=0"],
    r"config\.data\.mqar\.num_kv_pairs: must be positive",
  ),
  (
    "lr_inf",
    ["--config.optim.learning_rate=inf"],
    r"config\.optim\.learning_rate: must be a finite number, got inf",
  ),
  (
    "impl",
    ["--config.model.impl=bogus"],
    r"config\.model\.impl: got 'bogus'; expected one of \['auto', 'reference', 'chunked', 'pallas'\]",
  ),
  (
    "chunk_24",
    ["--config.model.chunk_size=24"],
    r"config\.model\.chunk_size: must be <= 16 or a multiple of 16, got 24",
  ),
  (
    "chunk_0",
    ["--config.model.chunk_size=0"],
    r"config\.model\.chunk_size: must be a positive int, got 0",
  ),
  (
    "info_scale_0",
    ["--config.model.info_scale=0"],
    r"config\.model\.info_scale: got '0'; expected one of",
  ),
  ("info_scale_neg", ["--config.model.info_scale=-2.5"], r"config\.model\.info_scale: got '-2\.5'"),
  (
    "info_scale_str",
    ["--config.model.info_scale=huge"],
    r"config\.model\.info_scale: got 'huge'; .*positive finite float",
  ),
  (
    "num_heads",
    ["--config.model.num_heads=0"],
    r"config\.model\.num_heads: must be a positive int, got 0",
  ),
  (
    "head_dim",
    ["--config.model.head_dim=0"],
    r"config\.model\.head_dim: must be a positive int, got 0",
  ),
  (
    "swa_window",
    ["--config.model.swa_window=-3"],
    r"config\.model\.swa_window: must be a positive int, got -3",
  ),
  ("r_min", ["--config.model.r_min=0"], r"config\.model\.r_min: must be > 0 and finite, got 0"),
  (
    "dt_range",
    ["--config.model.dt_min=0.1", "--config.model.dt_max=0.01"],
    r"config\.model\.dt_min: must be below dt_max = 0\.01, got 0\.1",
  ),
  (
    "a_min",
    ["--config.model.a_min=-1"],
    r"config\.model\.a_min: must be a positive finite number, got -1",
  ),
  (
    "mamba2_variant",
    ["--config.model.mamba2_variant=mamba3"],
    r"config\.model\.mamba2_variant: got 'mamba3'; expected one of \['normalized', 'faithful', 'official'\]",
  ),
  (
    "layer_pattern",
    ["--config.model.layer_pattern=kdn_diag,lstm"],
    r"config\.model\.layer_pattern: unknown mixer 'lstm' in 'kdn_diag,lstm'",
  ),
  (
    "dtype",
    ["--config.model.dtype=float16"],
    r"config\.model\.dtype: got 'float16'; expected one of \('float32', 'bfloat16'\)",
  ),
  (
    "lr_sweep",
    ["--config.train.lr_sweep=abc"],
    r"config\.train\.lr_sweep: must be distinct positive learning rates",
  ),
  (
    "key_typo",
    ["--config.optim.learning_rat=1e-3"],
    r"unknown config key 'config\.optim\.learning_rat' \(did you mean 'config\.optim\.learning_rate'\?\)",
  ),
  (
    "key_wrong_section",
    ["--config.train.learning_rate=1e-3"],
    r"unknown config key 'config\.train\.learning_rate' \(did you mean 'config\.optim\.learning_rate'\?\)",
  ),
  (
    "model_key_typo",
    ["--config.model.chunk_sise=16"],
    r"unknown config key 'config\.model\.chunk_sise' \(did you mean 'config\.model\.chunk_size'\?\)",
  ),
  ("flagfile", None, r"--flagfile: cannot read '.*nosuch\.flags' \(No such file or directory\)"),
  ("workdir_file", None, r"--workdir=.*a_file: is a file; expected a directory"),
  (
    "token_file",
    None,
    r"config\.data\.train_path: .*garbage\.npy: not a readable \.npy array of token ids",
  ),
  (
    "token_ids",
    None,
    r"config\.data\.eval_path: .*eval\.npy: token id 40 at position 3 is outside "
    r"\[0, vocab_size=32\)",
  ),
  ("workdir_busy", None, r".*busy is in use by another run \(pid \d+ on "),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """{case id: (returncode, stderr, stdout)} of every case, run in one batch."""
  tmp = tmp_path_factory.mktemp("cli")
  (tmp / "a_file").write_text("not a directory")
  (tmp / "garbage.npy").write_bytes(b"\x93NUMPY but not really" * 3)
  np.save(tmp / "train.npy", np.arange(200, dtype=np.int32) % 32)
  np.save(tmp / "eval.npy", np.array([1, 2, 3, 40] + [5] * 100, np.int32))
  busy = tmp / "busy"
  busy.mkdir()
  # held by this (live) test process: the children are other processes
  (busy / "run.lock").write_text(
    json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": None, "since": "now"})
  )
  wd = f"--workdir={tmp}/w"
  tok = [
    SMOKE,
    "--config.data.kind=token_file",
    "--config.model.vocab_size=32",
    "--config.data.seq_len=16",
  ]
  special = {
    "flagfile": [f"--flagfile={tmp}/nosuch.flags", wd],
    "workdir_file": [SMOKE, f"--workdir={tmp}/a_file"],
    "token_file": tok + [f"--config.data.train_path={tmp}/garbage.npy", wd],
    "token_ids": tok
    + [f"--config.data.train_path={tmp}/train.npy", f"--config.data.eval_path={tmp}/eval.npy", wd],
    "workdir_busy": [SMOKE, f"--workdir={busy}"],
  }
  argvs = [special[name] if extra is None else [SMOKE, *extra, wd] for name, extra, _ in CASES]
  r = run_one_device([os.path.join(ROOT, "tests", "train_cli_batch.py"), json.dumps(argvs)])
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
  assert len(rows) == len(CASES), r.stdout[-2000:]
  assert not os.path.exists(tmp / "w")  # nothing was built
  return {
    name: (row["returncode"], row["stderr"], row["stdout"], row["argv"])
    for (name, _, _), row in zip(CASES, rows)
  }


@pytest.mark.parametrize("name, pattern", [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_value_is_one_config_error_line(results, name, pattern):
  code, err, _, argv = results[name]
  lines = err.strip().splitlines()
  assert code == 2, (argv, err[-2000:])
  assert len(lines) == 1 and lines[0].startswith("Config error: "), (argv, err[-2000:])
  assert re.search(pattern, lines[0]), (argv, lines[0])


@pytest.mark.parametrize("name", ["flagfile", "chunk_24"])
def test_a_fresh_process_gives_the_same_line(results, name):
  """The batch's children behave as `python -m experiments.train` (the flagfile case fails while the
  module is imported in a fresh process, at flag parsing in a child: the same line either way)."""
  code, err, _, argv = results[name]
  r = run_one_device(["-m", "experiments.train", *argv], timeout=300)
  assert (r.returncode, r.stderr) == (code, err)


def test_did_you_mean_searches_every_section():
  """A key in the wrong section finds its own name elsewhere before a close name in its section; a
  typo in the section's name keeps the leaf; a key's own section is never the answer."""
  from experiments.schema import did_you_mean  # pylint: disable=g-import-not-at-top

  assert (
    did_you_mean("config.train.learning_rate") == " (did you mean 'config.optim.learning_rate'?)"
  )
  assert did_you_mean("config.optim.seq_len") == " (did you mean 'config.data.seq_len'?)"
  assert did_you_mean("config.trian.num_steps") == " (did you mean 'config.train.num_steps'?)"
  assert did_you_mean("config.train.num_step") == " (did you mean 'config.train.num_steps'?)"
  assert did_you_mean("config.train.lr") == ""
