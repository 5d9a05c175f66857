"""Progress lines, JSONL + TensorBoard metrics, the end-of-run summary JSON and a PNG loss curve."""

from __future__ import annotations

import json
import logging
import os
import time


def fmt_time(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricWriter:
  """Writes metrics.jsonl and TensorBoard events under ``workdir`` (process 0 only)."""

  def __init__(
    self,
    workdir: str,
    tensorboard: bool = True,
    active: bool = True,
    resume_step: int | None = None,
  ):
    """``resume_step``: the step training (re)starts from; rows and events after it are dropped first."""
    self.workdir, self.active = workdir, active
    self.tb = None
    if not active:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None:
      truncate_metrics(path, resume_step)
    self.jsonl = open(path, "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

        # purge_step: TensorBoard hides this directory's older events at steps >= it
        purge = None if resume_step is None else resume_step + 1
        self.tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge)
      except ImportError:
        logging.warning("tensorboardX not installed: no TensorBoard event files")

  def write(self, step: int, split: str, metrics: dict):
    if not self.active:
      return
    rec = {
      "step": int(step),
      "split": split,
      "time": time.time(),
      **{k: float(v) for k, v in metrics.items()},
    }
    self.jsonl.write(json.dumps(rec) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in metrics.items():
        self.tb.add_scalar(f"{split}/{k}", float(v), int(step))

  def close(self):
    if not self.active:
      return
    self.jsonl.close()
    if self.tb is not None:
      self.tb.close()


def truncate_metrics(path: str, last_step: int) -> int:
  """Drops the rows of a metrics JSONL after ``last_step`` (and a torn last line from a kill mid-write),
  atomically; returns how many rows were dropped."""
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  keep = []
  for line in lines:
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      continue
    if int(rec.get("step", 0)) <= last_step:
      keep.append(line if line.endswith("\n") else line + "\n")
  if len(keep) == len(lines) and (not lines or lines[-1].endswith("\n")):
    return 0
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return len(lines) - len(keep)


def read_metrics(workdir: str, split: str | None = None) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    recs = [json.loads(line) for line in f if line.strip()]
  return [r for r in recs if split is None or r["split"] == split]


def progress_line(step, total, metrics, tokens_per_s, eta_s) -> str:
  extra = " | ".join(
    f"{k} {v:.4g}" for k, v in metrics.items() if k in ("accuracy", "grad_norm", "lr")
  )
  speed = (
    "" if tokens_per_s is None else f" | {tokens_per_s / 1e3:.1f}k tok/s | ETA {fmt_time(eta_s)}"
  )
  return f"step {step}/{total} | loss {metrics['loss']:.4f} | {extra}{speed}"


def write_json(path: str, obj) -> str:
  """Writes ``obj`` as indented JSON atomically (tmp file + rename)."""
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def write_summary(workdir: str, summary: dict):
  write_json(os.path.join(workdir, "summary.json"), summary)


def plot_loss(workdir: str) -> str | None:
  """Plots train (and eval) loss from metrics.jsonl to loss.png; the last run segment wins per step.
  The title names the run (its folder, mixer and data when its config.json is there)."""
  train = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
  evals = {r["step"]: r["loss"] for r in read_metrics(workdir, "eval")}
  if not train:
    return None
  from experiments.runner import plot_style  # pylint: disable=g-import-not-at-top

  plt = plot_style.plt()
  fig, ax = plt.subplots(figsize=(6, 4))
  steps = sorted(train)
  ax.plot(steps, [train[s] for s in steps], label="train")
  if evals:
    es = sorted(evals)
    ax.plot(es, [evals[s] for s in es], "o-", label="eval")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log")
  plot_style.plain_log_ticks(ax)
  ax.set_title(loss_title(workdir), fontsize=9)
  plot_style.legend_outside(ax)
  ax.grid(alpha=0.3, which="both")
  path = os.path.join(workdir, "loss.png")
  fig.tight_layout()
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)
  return path


def loss_title(workdir: str) -> str:
  """'<run>: <mixer or layer pattern> on <data>, loss' (the run's folder alone without a config.json)."""
  name = os.path.basename(os.path.abspath(workdir).rstrip("/"))
  try:
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      cfg = json.load(f)
    model = cfg["model"].get("layer_pattern") or cfg["model"]["mixer"]
    return f"{name}: {model} on {cfg['data']['kind']}, loss"
  except (OSError, ValueError, KeyError, TypeError):
    return f"{name}: loss"


class Progress:
  """A progress line with rate and ETA, printed at most every ``every_s`` seconds (and at the end)."""

  def __init__(self, total: int, desc: str, every_s: float = 5.0):
    self.total, self.desc, self.every_s = max(int(total), 1), desc, every_s
    self.done, self.t0, self.t_print = 0, time.time(), 0.0

  def update(self, n: int = 1):
    self.done += n
    now = time.time()
    if self.done >= self.total or now - self.t_print >= self.every_s:
      self.t_print = now
      rate = self.done / max(now - self.t0, 1e-9)
      eta = (self.total - self.done) / max(rate, 1e-9)
      print(
        f"  {self.desc}: {self.done}/{self.total} | {fmt_time(now - self.t0)} elapsed | "
        f"ETA {fmt_time(eta)}",
        flush=True,
      )
