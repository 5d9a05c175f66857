"""The MQAR Zoology study: study.py runs it (``python -m experiments.studies.mqar_zoology``),
render.py renders its docs/RESULTS.md section, stats.py its statistics. Importers name the module
they need, so loading the renderer never defines the study's flags."""
