"""Renderers of docs/RESULTS.md sections: each module's ``render(results_dir, fig_dir) -> markdown`` reads only
the JSON the runs wrote under docs/results/ (``python -m experiments.studies.render_results`` calls them)."""
