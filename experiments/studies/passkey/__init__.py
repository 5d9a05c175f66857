"""The passkey study: study.py runs it (``python -m experiments.studies.passkey``), render.py
renders its docs/RESULTS.md section. Importers name the module they need, so loading the renderer
never defines the study's flags."""
