"""PNG plots of the evaluation suites (matplotlib, Agg backend)."""

from __future__ import annotations

import os

import numpy as np

from experiments.runner import plot_style

# MQAR is scored per query and copying per character (the papers' metrics); needle tasks by exact match.
METRIC = {
  "mqar": "token_accuracy",
  "copy": "token_accuracy",
  "passkey": "exact_match",
  "snih1": "exact_match",
  "snih2": "exact_match",
  "snih3": "exact_match",
}


def _plt():
  return plot_style.plt()


def run_title(res: dict) -> str:
  """'<run> @ step <n>: <data>' from a suite result's meta (what was evaluated, on what)."""
  meta = res.get("meta", {})
  run = os.path.basename(str(meta.get("workdir", "")).rstrip("/")) or "run"
  step = meta.get("step")
  data = res.get("data")
  return f"{run}" + (f" @ step {step}" if step is not None else "") + (f": {data}" if data else "")


def _save(fig, path):
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")  # (keeps a legend beside the axes in the PNG)
  _plt().close(fig)
  return path


def position_ppl(res: dict, path: str) -> str:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(9, 4))
  ax.plot(res["bucket_center"], res["bucket_ppl"], "-", lw=1.5, label="position-wise PPL")
  ax.axvline(
    res["train_len"], color="k", ls="--", lw=1, label=f"training length {res['train_len']}"
  )
  if res.get("p_star") is not None:
    se = res.get("p_star_log_se")
    noise = f", x/ {np.exp(se):.3f} s.e." if se is not None and np.isfinite(se) else ""
    ax.axhline(
      res["p_star"],
      color="tab:red",
      ls=":",
      lw=1,
      label=f"p* = {res['p_star']:.2f} (best bucket{noise}; biased low)",
    )
  ax.set_xscale("log")
  ax.set_yscale("log")
  plot_style.plain_log_ticks(ax)
  plot_style.plain_log_ticks(ax, "x", minor=False)
  ax.set_xlabel("position t (tokens)")
  ax.set_ylabel("perplexity at t")
  ax.set_title(
    f"{run_title(res)}\n{res['sequences']} sequences of {res['max_len']} tokens", fontsize=9
  )
  ax.grid(alpha=0.3, which="both")
  plot_style.legend_outside(ax)
  return _save(fig, path)


def topic_floor(res: dict, path: str, label: str = "") -> str:
  """Excess NLL over the Bayes floor by position (log x) with its bootstrap band, the two verdict
  windows shaded, the paper's claim in the title and the verdict in the caption."""
  import textwrap  # pylint: disable=g-import-not-at-top

  plt = _plt()
  fig, ax = plt.subplots(figsize=(9.5, 4.6))
  x = np.asarray(res["bucket_center"])
  ex = res["excess"]
  est, lo, hi = (np.asarray(ex[k]) for k in ("estimate", "lo", "hi"))
  level = round(100 * ex["level"])
  ax.plot(x, est, "-", lw=1.5, label=label or "excess NLL (model - floor)")
  ax.fill_between(
    x, lo, hi, alpha=0.25, label=f"{level}% bootstrap band ({res['documents']} documents)"
  )
  for (a, b), name in ((res["early_window"], "early"), (res["late_window"], "late")):
    ax.axvspan(
      a + 1,
      b,
      color="tab:gray" if name == "early" else "tab:orange",
      alpha=0.12,
      label=f"{name} window: positions {a + 1}-{b}",
    )
  ax.axvline(
    res["train_len"], color="k", ls="--", lw=1, label=f"training length T = {res['train_len']}"
  )
  ax.axhline(0, color="k", lw=0.6)
  ax.set_xscale("log")
  ax.set_xlabel("position t (tokens)")
  ax.set_ylabel("excess NLL over the Bayes floor (nats)")
  ax.set_title("\n".join([run_title(res)] + textwrap.wrap(res.get("claim", ""), 90)), fontsize=8)
  r, g = res["ppl_ratio"], res["excess_growth"]
  fig.text(
    0.01,
    0.01,
    f"model PPL late / early = {r['estimate']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] ({level}% CI): "
    f"{res['verdict']}; excess growth {g['estimate']:.3f} [{g['lo']:.3f}, {g['hi']:.3f}] nats",
    fontsize=7.5,
  )
  ax.grid(alpha=0.3, which="both")
  plot_style.legend_outside(ax)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return path


def effrem(res: dict, path: str) -> str:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6, 4))
  t, m, s = np.asarray(res["t"]), np.asarray(res["mean"]), np.asarray(res["std"])
  ax.plot(t, m, "o-", ms=3, label="mean")
  ax.fill_between(t, np.clip(m - s, 0, 1), np.clip(m + s, 0, 1), alpha=0.2, label="± std")
  ax.axvline(
    res["T"] - res["train_len"],
    color="k",
    ls="--",
    lw=1,
    label=f"T - training length ({res['train_len']})",
  )
  ax.set_xlabel("prefix cut t")
  ax.set_ylabel(r"EffRem$_T$(t)")
  ax.set_ylim(0, 1)
  ax.set_title(f"Effective Remembrance, T = {res['T']}")
  ax.grid(alpha=0.3)
  ax.legend()
  return _save(fig, path)


def state_stats(res: dict, path: str) -> str:
  """One panel per (layer with a recurrent state, statistic), each with its own y-scale (layers differ by
  orders of magnitude); markers at the chunk ends where the state was read, no lines between them (nothing
  was sampled there). The x-axis is linear: the chunk ends are evenly spaced and t = 0 is the initial state."""
  plt = _plt()
  series = res["series"]
  layers = [i for i in range(len(series[0]["layers"])) if any(p["layers"][i] for p in series)]
  keys = [
    k
    for k in ("memory_norm", "memory_std", "variance_mean")
    if any(k in (p["layers"][i] or {}) for p in series for i in layers)
  ]
  if not layers or not keys:
    return ""
  fig, axes = plt.subplots(
    len(layers),
    len(keys),
    figsize=(3.8 * len(keys), 1.9 * len(layers) + 0.6),
    squeeze=False,
    sharex=True,
  )
  t = np.asarray([p["t"] for p in series], float)
  for r, i in enumerate(layers):
    for c, key in enumerate(keys):
      ax = axes[r, c]
      vals = np.asarray([(p["layers"][i] or {}).get(key, np.nan) for p in series], float)
      ok = ~np.isnan(vals)
      if ok.any():
        ax.plot(t[ok], vals[ok], "o", ms=3, color=f"C{r % 10}")
      else:
        ax.text(
          0.5,
          0.5,
          "none in this layer",
          ha="center",
          va="center",
          transform=ax.transAxes,
          fontsize=8,
        )
      ax.axvline(res["train_len"], color="k", ls="--", lw=0.8)
      ax.grid(alpha=0.3)
      ax.tick_params(labelsize=7)
      if r == 0:
        ax.set_title(key, fontsize=9)
      if c == 0:
        ax.set_ylabel(f"layer {i}", fontsize=8)
      if r == len(layers) - 1:
        ax.set_xlabel("position t (state read at chunk ends)", fontsize=8)
  fig.suptitle(
    f"{res['sequences']} sequences, chunk {res['chunk']}; dashed: training length {res['train_len']}",
    fontsize=9,
  )
  return _save(fig, path)


def beta_hist(res: dict, path: str) -> str:
  plt = _plt()
  bins = np.asarray(res["bins"])
  centers = 0.5 * (bins[1:] + bins[:-1])
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, s in res["layers"].items():
    h = np.asarray(s["hist"], float)
    ax.plot(centers, h / max(h.sum(), 1), label=f"layer {name} (mean {s['mean']:.3f})")
  ax.set_xlabel(r"$\beta_{eff} = z / (r + z)$")
  ax.set_ylabel("fraction of tokens x heads")
  ax.set_title("KDN effective write strength")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def retrieval(task: str, cells: list[dict], path: str) -> str:
  """Heatmap of exact match over length x the task's second axis (a line plot when it has one value)."""
  plt = _plt()
  axis = cells[0]["axis"]
  lengths = sorted({c["length"] for c in cells})
  points = sorted({c[axis] for c in cells}, key=lambda p: (p is None, p))
  metric = METRIC[task]
  if len(points) == 1 or task == "copy":
    fig, ax = plt.subplots(figsize=(6, 4))
    by_len = {c["length"]: c for c in cells}
    ax.plot(lengths, [by_len[n][metric] for n in lengths], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if "train_len" in cells[0]:
      ax.axvline(cells[0]["train_len"], color="k", ls="--", lw=1, label="training length")
      ax.legend()
  else:
    grid = np.full((len(points), len(lengths)), np.nan)
    for c in cells:
      grid[points.index(c[axis]), lengths.index(c["length"])] = c[metric]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.55 * len(points) + 2))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    for i in range(len(points)):
      for j in range(len(lengths)):
        if not np.isnan(grid[i, j]):
          ax.text(
            j,
            i,
            f"{grid[i, j]:.2f}",
            ha="center",
            va="center",
            fontsize=8,
            color="w" if grid[i, j] < 0.6 else "k",
          )
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(points)), [str(p) for p in points])
    ax.set_xlabel("sequence length")
    ax.set_ylabel(axis)
    fig.colorbar(im, ax=ax, label=metric.replace("_", " "))
  ax.set_title(f"{task}: {metric.replace('_', ' ')}")
  return _save(fig, path)


def save_all(out_dir: str, results: dict) -> list[str]:
  """Writes the PNG of every suite present in ``results``; returns the paths."""
  paths = []
  if "position_ppl" in results:
    paths.append(position_ppl(results["position_ppl"], os.path.join(out_dir, "position_ppl.png")))
  if "topic_floor" in results:
    paths.append(topic_floor(results["topic_floor"], os.path.join(out_dir, "topic_floor.png")))
  if "effrem" in results:
    paths.append(effrem(results["effrem"], os.path.join(out_dir, "effrem.png")))
  if results.get("state_stats", {}).get("series"):
    p = state_stats(results["state_stats"], os.path.join(out_dir, "state_stats.png"))
    if p:  # (no layer with a recurrent state: nothing to plot)
      paths.append(p)
  if results.get("beta_eff", {}).get("layers"):
    paths.append(beta_hist(results["beta_eff"], os.path.join(out_dir, "beta_eff.png")))
  for task, cells in results.get("retrieval", {}).get("tasks", {}).items():
    paths.append(retrieval(task, cells, os.path.join(out_dir, f"retrieval_{task}.png")))
  return paths
