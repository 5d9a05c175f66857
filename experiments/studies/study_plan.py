"""A study plan's identity, and what the (arm x stage) driver does with it: every run folder and
every result is tied to the plan that made it, so a study never continues or reuses work of another
plan, and never writes into the repository unless asked to publish.

The identity of one arm is its plan's settings (the plan object's attributes, less where and how fast
it runs: ``NOT_PLAN`` and the arm list), the run config of each stage (paths inside the workdir or the
corpus written relative to them) and the corpus manifest's hash. ``<workdir>/<arm>/plan.json`` keeps
it; every result JSON carries its hash (``plan_hash``) and its settings (``plan``).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil

from experiments.runner.logging_utils import write_json

# a plan's attributes that say where or how fast it runs, or which arms: not what an arm computes
NOT_PLAN = ("workdir", "results", "deadline", "fast_compile", "plots", "publish", "corpus_dir")
PLAN_FILE = "plan.json"
# the clone this code runs from (None when installed elsewhere): studies never write inside it
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.isdir(os.path.join(REPO, ".git")) and not os.path.isfile(os.path.join(REPO, ".git")):
  REPO = None


class PlanError(ValueError):
  """A study's folders belong to another plan (or to the repository)."""


def study_name(study) -> str:
  return study.module.rsplit(".", 1)[-1]


# ------------------------------------------------------------------------------------------ identity
def _plain(value, subs):
  """``value`` as JSON (tuples as lists), paths under the workdir or the corpus relative to them;
  None for what JSON cannot hold (a Deadline, a function)."""
  if isinstance(value, dict):
    return {str(k): _plain(v, subs) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, subs) for v in value]
  if isinstance(value, str):
    for prefix, name in subs:
      if prefix and (value == prefix or value.startswith(prefix.rstrip("/") + "/")):
        return name + value[len(prefix.rstrip("/")) :]
    return value
  if value is None or isinstance(value, (bool, int, float)):
    return value
  return None


def corpus_dir(config) -> str:
  """The prepared corpus a run config trains on, '' for generated data."""
  d = config.data
  return d.get("corpus_dir", "") if d.get("kind") == "token_file" else ""


def manifest_hash(directory: str) -> str | None:
  path = os.path.join(directory, "manifest.json")
  if not directory or not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def settings(study, plan, subs) -> dict:
  """The plan's own settings: its attributes less ``NOT_PLAN`` and the arm list."""
  skip = set(NOT_PLAN) | {f"{study.unit}s"}
  if hasattr(plan, "__dict__"):
    attrs = vars(plan)
  else:
    attrs = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
  return {
    k: _plain(v, subs)
    for k, v in sorted(attrs.items())
    if not k.startswith("_") and k not in skip and _plain(v, subs) is not None
  }


def stages(plan) -> list[str]:
  return ["pretrain", *plan.strategies]


def identity(study, plan, arm) -> dict:
  """What one arm's runs and results are made from (see the module docstring)."""
  configs = {s: plan.config(arm, s) for s in stages(plan)}
  corpus = corpus_dir(configs["pretrain"])
  subs = [(plan.workdir, "<workdir>"), (corpus, "<corpus>")]
  return {
    "study": study_name(study),
    "arm": arm,
    "settings": settings(study, plan, subs),
    "corpus_manifest": manifest_hash(corpus),
    "configs": {s: _plain(c.to_dict(), subs) for s, c in configs.items()},
  }


def identity_hash(ident: dict) -> str:
  return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def known_hash(plan, arm) -> str | None:
  """The arm's plan hash once ``lock`` has checked its folders (None before: nothing is reused)."""
  return getattr(plan, "_plan_hashes", {}).get(arm)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def difference(old: dict, new: dict, shown: int = 3) -> str:
  """The first ``shown`` differing keys (settings before configs), as 'key old -> new'."""
  a, b = _flat(old), _flat(new)
  keys = sorted(set(a) | set(b), key=lambda k: (not k.startswith("settings."), k))
  diff = [k for k in keys if a.get(k, "<absent>") != b.get(k, "<absent>")]
  text = ", ".join(
    f"{k.removeprefix('settings.')} {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
    for k in diff[:shown]
  )
  return text + (f" (and {len(diff) - shown} more)" if len(diff) > shown else "")


# ------------------------------------------------------------------------------------------ checks
def inside_repo(path: str) -> bool:
  if REPO is None:
    return False
  real, repo = os.path.realpath(path), os.path.realpath(REPO)
  return os.path.commonpath([real, repo]) == repo


def check_outside_repo(plan):
  for flag in ("workdir", "results"):
    path = getattr(plan, flag)
    if inside_repo(path):
      raise PlanError(
        f"--{flag}: {path} is inside the repository {REPO}; a study writes outside the clone "
        "(default: under its workdir) and copies its results into docs/results only with --publish"
      )


def arm_results(plan, arm) -> list[str]:
  """The result JSON of ``arm`` in the plan's results folder."""
  return sorted(glob.glob(os.path.join(glob.escape(plan.results), f"{glob.escape(arm)}.*.json")))


def read(path):
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def lock(study, plan, arms) -> dict[str, str]:
  """Ties each arm's run folder to this plan (``<workdir>/<arm>/plan.json``); a PlanError names the
  difference when a folder, or a result in the results folder, was made by another plan. Returns
  {arm: plan hash}."""
  check_outside_repo(plan)
  hashes = {}
  for arm in arms:
    ident = identity(study, plan, arm)
    h = hashes[arm] = identity_hash(ident)
    folder = os.path.join(plan.workdir, arm)
    path = os.path.join(folder, PLAN_FILE)
    kept = read(path)
    if kept is None and os.path.isdir(folder) and os.listdir(folder):
      raise PlanError(
        f"--workdir: {folder} holds runs without a plan record ({PLAN_FILE}), so they may be "
        "another plan's; use another --workdir or remove that folder"
      )
    if kept is not None and identity_hash(kept) != h:
      raise PlanError(
        f"--workdir: {folder} was made by another plan: {difference(kept, ident)}; use another "
        "--workdir to run this plan, or rerun with the old settings to continue it"
      )
    for result in arm_results(plan, arm):
      r = read(result) or {}
      if r.get("plan_hash") not in (None, h):
        raise PlanError(
          f"--results: {result} was made by another plan: "
          f"{difference({'settings': r.get('plan', {})}, {'settings': ident['settings']})}; "
          "use another --results folder"
        )
    if kept is None:
      os.makedirs(folder, exist_ok=True)
      write_json(path, ident)
  # kept on the plan (a frozen dataclass too) for the work lists, which see only plan and arm
  object.__setattr__(plan, "_plan_hashes", dict(getattr(plan, "_plan_hashes", {}), **hashes))
  return hashes


def current(plan, arm, path) -> bool:
  """Whether the result JSON at ``path`` was made by this plan (checked by ``lock``)."""
  h = known_hash(plan, arm)
  r = read(path)
  return h is not None and bool(r) and r.get("plan_hash") == h


def stamp(study, plan, arm, paths):
  """Records the arm's plan in each result JSON of ``paths`` the study just wrote."""
  ident = identity(study, plan, arm)
  h = identity_hash(ident)
  for path in paths:
    r = read(path)
    if isinstance(r, dict) and r.get("plan_hash") is None:
      write_json(path, dict(r, plan_hash=h, plan=ident["settings"]))


def publish(study, plan, arms) -> str:
  """Copies the results folder into ``docs/results/<study>/<folder>``, replacing what was published
  there for ``arms``; returns the destination."""
  if REPO is None:
    raise PlanError("--publish: this code does not run from a clone; there is no docs/results")
  dest = os.path.join(REPO, "docs", "results", study_name(study), os.path.basename(plan.results))
  os.makedirs(dest, exist_ok=True)
  for arm in arms:
    for old in glob.glob(os.path.join(glob.escape(dest), f"{glob.escape(arm)}.*")):
      os.remove(old)
  for name in sorted(os.listdir(plan.results)):
    src = os.path.join(plan.results, name)
    if os.path.isfile(src) and not name.endswith(".tmp"):
      shutil.copyfile(src, os.path.join(dest, name))
  return dest
