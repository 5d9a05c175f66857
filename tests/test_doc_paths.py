"""Docs that cannot go stale: every repository path and every `python -m` module named in
README.md, WORKSPACE.md, docs/*.md and the code's comments and docstrings exists.

A repository path is a relative path that starts with one of the repository's top-level folders
(TOP), e.g. `experiments/runner/trainer.py` or `tests/kernels/`; a path under another root
(/tmp/..., $OUT/..., <out>/docs/..., workdirs/...) is not one, nor is git's `<rev>:<path>`. A path
stops at a placeholder (`<op>`) and at `:preset`; `*` is a glob, `{a,b}` lists alternatives, and
`dir/module.name` names something in dir/module.py. A `python -m` module counts when its first part
is one of the repository's packages."""

import ast
import glob
import io
import itertools
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = (".ci", "configs", "docs", "experiments", "kdn_jax", "pallas_kernels", "tests")
PACKAGES = ("configs", "experiments", "kdn_jax", "pallas_kernels", "tests")
_TOP = "|".join(re.escape(t) for t in TOP)
# Not preceded by a path, a variable, a placeholder, a word or a git revision's colon.
PATH = re.compile(rf"(?<![\w./$~:>-])((?:{_TOP})/[\w.*/{{}},-]*)")
MODULE = re.compile(r"python3? -m ([\w.]+)")


def _doc_texts():
  """[(name, text)] of README.md, WORKSPACE.md and docs/*.md."""
  names = ["README.md", "WORKSPACE.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
  )
  out = []
  for name in names:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      out.append((name, f.read()))
  return out


def _comments_and_docstrings(src):
  """The comments and docstrings of one Python source, as one text."""
  parts = [
    tok.string
    for tok in tokenize.generate_tokens(io.StringIO(src).readline)
    if tok.type == tokenize.COMMENT
  ]
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        parts.append(doc)
  return "\n".join(parts)


def _code_missing():
  """_missing over the comments and docstrings of every Python file and the shell scripts'
  comments. (A file whose whole text names nothing missing is not parsed: that text holds its
  comments and docstrings.)"""
  bad = []
  for top in PACKAGES:
    for path in sorted(glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)):
      with open(path, encoding="utf-8") as f:
        src = f.read()
      name = os.path.relpath(path, ROOT)
      if _missing([(name, src)]):
        bad += _missing([(name, _comments_and_docstrings(src))])
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "**", "*.sh"), recursive=True)):
    with open(path, encoding="utf-8") as f:
      text = "\n".join(line for line in f if line.lstrip().startswith("#"))
    bad += _missing([(os.path.relpath(path, ROOT), text)])
  return bad


def _expand(path):
  """`a/{b,c}/d` -> [a/b/d, a/c/d]."""
  pieces = re.split(r"\{([^{}]*)\}", path)
  alts = [p.split(",") if i % 2 else [p] for i, p in enumerate(pieces)]
  return ["".join(c) for c in itertools.product(*alts)]


def _exists(path):
  if path.count("{") != path.count("}"):  # a brace list cut by the line: check what precedes it
    path = path[: path.index("{")]
  return all(_one_exists(p) for p in _expand(path))


def _one_exists(path):
  full = os.path.join(ROOT, path)
  if glob.glob(full) if "*" in path else os.path.exists(full):
    return True
  # dir/module.name (or a wrapped dir/module.): the module, and the name in it
  module, _, name = full.partition(".")
  if not os.path.exists(module + ".py"):
    return False
  with open(module + ".py", encoding="utf-8") as f:
    return not name or re.search(rf"\b{re.escape(name)}\b", f.read()) is not None


def _module_exists(mod):
  base = os.path.join(ROOT, *mod.split("."))
  return os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__main__.py"))


def _missing(texts):
  bad = []
  for name, text in texts:
    for path in PATH.findall(text):
      path = path.rstrip(".,")
      if not _exists(path):
        bad.append(f"{name}: {path}")
    for mod in MODULE.findall(text):
      mod = mod.rstrip(".")
      if mod.split(".")[0] in PACKAGES and not _module_exists(mod):
        bad.append(f"{name}: python -m {mod}")
  return sorted(set(bad))


def test_top_level_folders_exist():
  for top in TOP:
    assert os.path.isdir(os.path.join(ROOT, top)), top


def test_docs_name_existing_paths_and_modules():
  assert _missing(_doc_texts()) == []


def test_code_comments_and_docstrings_name_existing_paths_and_modules():
  assert _code_missing() == []


def test_a_stale_path_or_module_is_found():
  texts = [
    ("a.md", "see `tests/test_runner.py`, run python -m experiments.benchmark_mixers"),
    (
      "b.md",
      "`pallas_kernels/{kdn_gain,no_such_op}/`, $OUT/tests/x.py, /tmp/docs/y.md, <out>/docs/z",
    ),
    ("c.md", "kdn_jax/ops/dispatch.NO_SUCH_NAME, kdn_jax/ops/dispatch.PALLAS_AUTO_PLATFORMS"),
    ("d.md", "git show 6ab1854^:docs/benchmark_mixers.md; configs/mqar.py:smoke"),
  ]
  assert _missing(texts) == [
    "a.md: python -m experiments.benchmark_mixers",
    "a.md: tests/test_runner.py",
    "b.md: pallas_kernels/{kdn_gain,no_such_op}/",
    "c.md: kdn_jax/ops/dispatch.NO_SUCH_NAME",
  ]
