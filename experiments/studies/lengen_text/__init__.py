"""The length-generalisation study on text at a short context: study.py runs it
(``python -m experiments.studies.lengen_text``), render.py renders its docs/RESULTS.md section.
Importers name the module they need, so loading the renderer never defines the study's flags."""
