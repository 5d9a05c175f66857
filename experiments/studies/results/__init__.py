"""What every docs/RESULTS.md renderer shares (common.py: loading, tables, figures, intervals) and
the renderers of sections that are no one study's (several sources, or runs of train.py and
evaluate.py): each module's ``render(results_dir, fig_dir) -> markdown`` reads only the JSON the
runs wrote under docs/results/. A study's own section is its folder's render.py; all of them are
called by ``python -m experiments.studies.render_results``."""
