"""Renders docs/RESULTS.md from the JSON the runs wrote under docs/results/ (never from typed numbers).

python -m experiments.studies.render_results [--results=docs/results] [--out=docs/RESULTS.md]
"""

from __future__ import annotations

import argparse
import importlib
import os

HEADER = """# Results: the seeds' claims tested at small scale

Every table and figure below is rendered by `python -m experiments.studies.render_results` from the JSON that the
training and evaluation runs wrote (copied under `docs/results/<study>/`, with each study's exact commands in
its `commands.json`). A study not run yet says so.
"""

# (title, 'module:function' under experiments.studies, or None where no renderer exists yet): a
# study's own section is rendered by its folder's render.py, a section drawn from several sources by
# a module of results/
SECTIONS = (
  ("1. MQAR", "mqar_zoology.render:render"),
  ("2. Information scale", "results.info_scale:render"),
  ("3. Length generalisation", "results.lengen:render"),
  ("3b. Length generalisation on a synthetic source", "lengen_synthetic.render:render"),
  ("3c. Length generalisation on text at a short context", "lengen_text.render:render"),
  ("3d. Where length generalisation fails: the map", "lengen_map.render:render"),
  ("4. Copying and passkey", "results.copy_passkey:render"),
  ("4b. Passkey past the training length, with seeds", "passkey.render:render"),
  ("4c. Copying at the paper's scale, with seeds", "copying.render:render"),
  ("5. S-NIAH", "results.lengen:render_sniah"),
  ("Appendix: evaluation cost", "results.eval_cost:render"),
)


def render(results_dir: str, fig_dir: str | None = None) -> str:
  fig_dir = fig_dir or os.path.join(results_dir, "figures")
  parts = [HEADER]
  for title, target in SECTIONS:
    md = ""
    if target:
      module, fn = target.split(":")
      md = getattr(importlib.import_module(f"experiments.studies.{module}"), fn)(
        results_dir, fig_dir
      )
    parts.append(md or f"## {title}\n\nNot run yet.\n")
  return "\n".join(parts)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results", default="docs/results")
  p.add_argument("--out", default="docs/RESULTS.md")
  a = p.parse_args(argv)
  md = render(a.results)
  tmp = a.out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(md)
  os.replace(tmp, a.out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
