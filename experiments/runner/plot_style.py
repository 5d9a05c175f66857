"""What every PNG the experiments write shares: matplotlib on the Agg backend, legends beside the axes
(never over a curve), plain numbers on log axes and colours for overlays of many curves."""

from __future__ import annotations

# an overlay of more curves than this takes its colours from a sequential colour map in the curves'
# order (training progress reads as light -> dark); the default cycle's colours are hard to tell apart
# past a few, and neighbouring ones carry no order
MAX_CYCLE_CURVES = 4


def plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as p  # pylint: disable=g-import-not-at-top

  return p


def legend_outside(ax, fontsize: float = 7.5, **kw):
  """The legend to the right of the axes: it cannot hide a curve, wherever the curves run (save the
  figure with bbox_inches='tight' or tight_layout so it stays inside the PNG)."""
  return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=fontsize, **kw)


def plain_log_ticks(ax, which: str = "y", minor: bool = True):
  """Log-axis tick labels as plain numbers (2, 5, 8, 20, 0.5), not '8x10^0': the labels a reader of a
  loss or perplexity axis compares against. Minor ticks are labelled only where the axis spans few
  decades (matplotlib's own rule), so a wide axis keeps its decade labels alone; ``minor=False`` labels
  only the decades (an x axis, whose labels sit side by side)."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  class Plain(ticker.LogFormatter):
    def __call__(self, x, pos=None):  # matplotlib picks the ticks to label, '%g' writes them
      return f"{x:g}" if super().__call__(x, pos) else ""

  axis = ax.yaxis if which == "y" else ax.xaxis
  axis.set_major_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.6)))
  axis.set_minor_formatter(
    Plain(labelOnlyBase=False, minor_thresholds=(2, 0.6)) if minor else ticker.NullFormatter()
  )


def curve_colors(n: int) -> list:
  """n colours: the default cycle for a few curves, evenly spaced viridis (dark -> light) for more."""
  p = plt()
  if n <= MAX_CYCLE_CURVES:
    return [f"C{i}" for i in range(n)]
  cmap = p.get_cmap("viridis")
  return [cmap(0.9 * i / max(n - 1, 1)) for i in range(n)]
