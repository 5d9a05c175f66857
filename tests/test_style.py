"""The one style (pyproject.toml's [tool.ruff]): the tree is ruff-formatted and lint-clean."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff(*args):
  exe = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
  return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_tree_is_formatted():
  res = _ruff("format", "--check", ".")
  assert res.returncode == 0, res.stdout + res.stderr


def test_tree_is_lint_clean():
  res = _ruff("check", ".")
  assert res.returncode == 0, res.stdout + res.stderr
