"""The length-generalisation map: study.py runs it (``python -m experiments.studies.lengen_map``),
render.py renders its docs/RESULTS.md section. Importers name the module they need, so loading the
renderer never defines the study's flags."""
