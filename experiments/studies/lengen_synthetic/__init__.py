"""The length-generalisation study on the synthetic topic source: study.py runs it
(``python -m experiments.studies.lengen_synthetic``), render.py renders its docs/RESULTS.md section.
Importers name the module they need, so loading the renderer never defines the study's flags."""
