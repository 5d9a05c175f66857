"""The import graph reads top-down (configs -> experiments -> kdn_jax -> pallas_kernels) and has no
cycles, counting imports inside functions too (they hide a cycle, they do not remove it)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("configs", "experiments", "kdn_jax", "pallas_kernels")
# a package may import only packages listed after it (and itself)
BELOW = {p: set(PACKAGES[i:]) for i, p in enumerate(PACKAGES)}
# runners of one experiment's config file (they read its grid definition)
ALLOWED_UP = {
  ("experiments.studies.lengen_synthetic.study", "configs.lengen_synthetic"),
  ("experiments.studies.lengen_text.study", "configs.lengen_short"),
  ("experiments.studies.mqar_zoology.study", "configs.mqar_zoology"),
  ("experiments.studies.mqar_zoology_sweep", "configs.mqar_zoology"),
  ("experiments.studies.init_write_strength", "configs.mqar_zoology"),
  ("experiments.studies.passkey.study", "configs.passkey"),
  ("experiments.studies.lengen_map.study", "configs.lengen_map"),
  ("experiments.studies.copying.study", "configs.copying"),
  ("experiments.benchmarks.sweep_memory", "configs.mqar_zoology"),
}


def _modules():
  mods = {}
  for pkg in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f[:-3]), ROOT).replace(os.sep, ".")
          mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(
            dirpath, f
          )
  return mods


def _graph():
  mods = _modules()
  edges = {m: set() for m in mods}
  for m, path in mods.items():
    with open(path) as fh:
      tree = ast.parse(fh.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from pkg import mod` depends on pkg.mod only, `from mod import name` on mod
        targets = [
          f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
          for a in node.names
        ]
      else:
        continue
      edges[m] |= {t for t in targets if t in mods and t != m}
  return edges


def _cycles(edges):
  index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = n[0]
    n[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  assert _cycles(_graph()) == []


def test_imports_point_down():
  bad = [
    (m, t)
    for m, ts in _graph().items()
    for t in ts
    if t.split(".")[0] not in BELOW[m.split(".")[0]] and (m, t) not in ALLOWED_UP
  ]
  assert bad == []


# experiments' lowest layers: the run-config schema (and the kernel-config specs it parses) import
# nothing else of experiments; the data pipeline reads the schema, never the runner above it
LOW = ("experiments.schema", "experiments.kernel_config")


def test_experiments_data_and_schema_sit_low():
  def inside(name, pkg):
    return name == pkg or name.startswith(pkg + ".")

  bad = [
    (m, t)
    for m, ts in _graph().items()
    for t in ts
    if inside(t, "experiments")
    and (
      (m in LOW and t not in LOW)
      or (inside(m, "experiments.data") and not inside(t, "experiments.data") and t not in LOW)
    )
  ]
  assert bad == []


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_configs_reach_the_code_through_common():
  """Each experiment config imports configs.common (or a config it builds on) and nothing else of
  the repository: the shared sizes and grammar live in one place."""
  bad = [
    (m, t)
    for m, ts in _graph().items()
    if m.startswith("configs.") and m != "configs.common"
    for t in ts
    if not t.startswith("configs.")
  ]
  assert bad == []
