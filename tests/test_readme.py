"""README.md's code runs as pasted: every ```python block executes in a fresh interpreter (a block that needs
a trained run says so in a `<!-- readme-test: skip (reason) -->` line right above it), and every
`python -m <module>` and `--config=<file>:<preset>` in its ```bash blocks names a module / config that
exists."""

import os
import re
import subprocess
import sys

import pytest
from runner_helpers import ROOT, one_device_env

README = os.path.join(ROOT, "README.md")
SKIP = re.compile(r"<!-- readme-test: skip \((.+)\) -->\s*$")


def _blocks(lang):
  """[(line number, code, skip reason or None)] of the README's ```<lang> blocks."""
  with open(README, encoding="utf-8") as f:
    lines = f.read().split("\n")
  out, i = [], 0
  while i < len(lines):
    if lines[i].strip() == f"```{lang}":
      start = i
      j = i + 1
      while lines[j].strip() != "```":
        j += 1
      prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
      m = SKIP.search(prev)
      out.append((start + 1, "\n".join(lines[start + 1 : j]), m[1] if m else None))
      i = j
    i += 1
  return out


PY = _blocks("python")


def test_readme_has_python_blocks_and_skips_say_why():
  assert len(PY) >= 2
  assert all(reason is None or len(reason) > 10 for _, _, reason in PY)


@pytest.mark.parametrize(
  "line,code",
  [(n, c) for n, c, why in PY if why is None],
  ids=[f"README.md:{n}" for n, _, why in PY if why is None],
)
def test_python_block_runs_as_pasted(line, code, tmp_path):
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    env=one_device_env(),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, f"README.md line {line}:\n{out.stderr[-3000:]}"


def test_bash_blocks_name_existing_modules_and_configs():
  text = "\n".join(code for _, code, _ in _blocks("bash"))
  modules = set(re.findall(r"python3? -m ([\w.]+)", text)) - {"venv", "pytest", "pip"}
  assert "experiments.train" in modules and "experiments.lm_eval_adapter" in modules
  for mod in modules:
    path = os.path.join(ROOT, *mod.split("."))
    assert os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__main__.py")), mod
  for cfg, preset in re.findall(r"--config=(configs/[\w/]+\.py):(\w+)", text):
    with open(os.path.join(ROOT, cfg), encoding="utf-8") as f:
      assert re.search(rf"['\"]{preset}['\"]", f.read()), f"{cfg} has no preset {preset!r}"
