"""orbax CheckpointManager wrapper: train state (params, optimizer, step, RNG, carried states, fitted-noise
statistics) + grain iterator state + a small JSON record; periodic and final saves, keep-N, async saves.

The record carries a checksum of every array (array_checksum.py) and of every process's data-iterator state,
verified after each restore together with the iterator's position (one batch per step: it must equal the
step): a checkpoint whose bytes fail them is set aside like an unreadable one. A checkpoint whose arrays
are another tree (another mixer, width, vocabulary) is refused before anything is moved or restored: its
bytes are sound, the config is not the one it was saved with. A save that cannot be written (a full disk) raises
CheckpointSaveError with one line; orbax's own error logs of that save are held back, and the incomplete
step is never listed, so the workdir resumes from its last complete checkpoint."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from experiments.runner import array_checksum, orbax_noise


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flatten(tree) -> dict:
  """{'a|b|0': leaf} for every array leaf (None subtrees vanish)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"|".join(_key_str(k) for k in path): leaf for path, leaf in leaves}


def unflatten(template, flat: dict):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  return jax.tree_util.tree_unflatten(
    treedef, [flat["|".join(_key_str(k) for k in path)] for path, _ in leaves]
  )


def find_checkpoint(source: str) -> tuple[str, int]:
  """(checkpoints directory, step) of ``source``: a run's workdir (its latest checkpoint), its
  ``checkpoints`` directory, or one step directory ``.../checkpoints/<step>``."""
  source = os.path.abspath(source)
  if not os.path.isdir(source):
    raise FileNotFoundError(f"no such directory: {source!r}")
  base = os.path.basename(source.rstrip("/"))
  if base.isdigit() and os.path.isdir(os.path.join(source, "state")):
    return os.path.dirname(source), int(base)
  root = os.path.join(source, "checkpoints")
  root = root if os.path.isdir(root) else source
  steps = ocp.utils.checkpoint_steps(root) if os.path.isdir(root) else []
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {source!r} (expected <workdir>/checkpoints/<step>)")
  return root, max(steps)


def _saved_shapes(state_dir: str) -> dict:
  """{flat key: shape} of a saved train state, read from its metadata only (no arrays)."""
  with (
    orbax_noise.quiet_missing_metadata()
  ):  # the step-level metadata file lives one level up: a harmless warning
    meta = ocp.PyTreeCheckpointer().metadata(state_dir)
  meta = getattr(meta, "item_metadata", meta)
  meta = getattr(meta, "tree", meta)
  if meta is None:
    raise ValueError(f"{state_dir}: its array metadata is missing or damaged")
  return {k: tuple(getattr(v, "shape", ())) for k, v in dict(meta).items()}


def _misfit(have: dict, want: dict, prefix: str = "") -> str:
  """'' when the saved arrays whose keys start with ``prefix`` are exactly the wanted ones, with their
  shapes; else a short list of the differences."""
  first = lambda k: (not k.startswith("params|"), k)  # parameters first: they name the change
  missing = sorted((k for k in want if k not in have), key=first)
  extra = sorted((k for k in have if k.startswith(prefix) and k not in want), key=first)
  wrong = [
    f"{k}: checkpoint {have[k]}, model {tuple(want[k].shape)}"
    for k in sorted(want, key=first)
    if k in have and have[k] != tuple(want[k].shape)
  ]
  if not missing and not extra and not wrong:
    return ""
  return (
    f"{len(missing)} arrays missing, {len(extra)} not in this model, {len(wrong)} of another "
    "shape: "
    + "; ".join(
      [f"missing {k}" for k in missing[:3]] + [f"extra {k}" for k in extra[:3]] + wrong[:3]
    )
  )


class CheckpointMismatchError(ValueError):
  """A readable checkpoint saved by another model or config (not damage: it is left in place)."""


class CheckpointCorruptError(ValueError):
  """A checkpoint whose restored arrays or data state differ from the checksums saved with them."""


class CheckpointUnreadableError(CheckpointCorruptError):
  """A checkpoint whose parameters cannot be read (damaged files, failed checksums); ``step`` names it."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (one line: the step, the directory, the cause, what to do)."""


def data_state_bytes(data_iter) -> bytes:
  """The data iterator's state as saved (grain's dict state as canonical JSON; a composite iterator's
  own bytes)."""
  state = data_iter.get_state()
  return state if isinstance(state, bytes) else json.dumps(state, sort_keys=True).encode()


def data_positions(raw: bytes) -> list[int]:
  """Every ``next_index`` (batches drawn) in a data iterator state: grain's, or a JSON list of them."""
  found = []

  def walk(x):
    if isinstance(x, dict):
      for k, v in x.items():
        if k == "next_index" and isinstance(v, int):
          found.append(v)
        else:
          walk(v)
    elif isinstance(x, list):
      for v in x:
        walk(v)
    elif isinstance(x, (bytes, str)):
      try:
        walk(json.loads(x))
      except ValueError:
        pass

  walk(raw)
  return found


def _data_checksums(data_iter) -> list[str]:
  """sha256 of every process's data-iterator state, by process index (a collective call)."""
  mine = hashlib.sha256(data_state_bytes(data_iter)).digest()
  if jax.process_count() == 1:
    return [mine.hex()]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  every = np.asarray(multihost_utils.process_allgather(np.frombuffer(mine, np.uint8)))
  return [bytes(row.astype(np.uint8)).hex() for row in every.reshape(jax.process_count(), -1)]


def verify_data(record: dict, data_iter, step: int, where: str):
  """Raises CheckpointCorruptError when the restored data-iterator state differs from its checksum in
  ``record`` (a record from before they were kept is not checked), or when its position is not
  ``step`` (the runner draws one batch per step)."""
  raw = data_state_bytes(data_iter)
  saved = record.get("data_checksums") if isinstance(record, dict) else None
  index = jax.process_index()
  if saved and len(saved) == jax.process_count():
    if hashlib.sha256(raw).hexdigest() != saved[index]:
      raise CheckpointCorruptError(
        f"{where}: the data iterator state (data/process_{index}-of-{jax.process_count()}.json) "
        "differs from its saved checksum"
      )
  wrong = [p for p in data_positions(raw) if p != step]
  if wrong:
    raise CheckpointCorruptError(
      f"{where}: the data iterator state is at batch {wrong[0]}, not at its step {step}"
    )


def verify(record: dict, flat: dict, where: str):
  """Raises CheckpointCorruptError when an array of ``flat`` fails the checksum in ``record`` (a record
  without checksums, from before they were kept, is not checked)."""
  saved = record.get("checksums") if isinstance(record, dict) else None
  if not saved:
    return
  bad = array_checksum.mismatches(saved, flat)
  if bad:
    raise CheckpointCorruptError(
      f"{where}: {len(bad)} array(s) differ from their saved checksum "
      f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    )


def _record_error(step_dir: str, e: Exception) -> CheckpointCorruptError:
  return CheckpointCorruptError(
    f"{os.path.join(step_dir, 'record', 'metadata')}: not a readable checkpoint record "
    f"({orbax_noise.describe(e)})"
  )


def read_record(step_dir: str) -> dict:
  """The JSON record of one checkpoint step directory, read without a CheckpointManager (which would clean
  up the in-flight save of a run training in that directory); one that does not read is a
  CheckpointCorruptError naming its file."""
  try:
    return dict(
      ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(step_dir, "record"))
    )
  except Exception as e:  # pylint: disable=broad-except  (missing, truncated or not JSON)
    raise _record_error(step_dir, e) from None


# The hooks of failed parameter reads stay installed: the caller (evaluation, a post-training start)
# reports the failure and exits, and the abandoned reads can arrive after any quiet window.
_PARAM_READ_HOOKS = []


def restore_params(source: str, abstract_params) -> tuple[object, int]:
  """Restores only the parameters of another run's checkpoint into ``abstract_params`` (a pytree of
  ShapeDtypeStructs with shardings, the ``params`` of a train state); returns (params, step).

  Raises ValueError naming the first parameters that are missing or differ in shape, before reading
  any array."""
  root, step = find_checkpoint(source)
  state_dir = os.path.join(root, str(step), "state")
  want = {f"params|{k}": v for k, v in flatten(abstract_params).items()}
  have, error = orbax_noise.quietly(lambda: _saved_shapes(state_dir), keep=_PARAM_READ_HOOKS)
  if error:  # missing or damaged metadata
    raise CheckpointUnreadableError(f"checkpoint {root}/{step} is unreadable ({error})", step)
  problems = _misfit(have, want, "params|")
  if problems:
    raise CheckpointMismatchError(f"checkpoint {root}/{step} does not fit this model ({problems})")
  restore_args = jax.tree.map(
    lambda v: ocp.ArrayRestoreArgs(sharding=v.sharding, dtype=v.dtype), want
  )
  out, error = orbax_noise.quietly(
    lambda: ocp.PyTreeCheckpointer().restore(
      state_dir,
      args=ocp.args.PyTreeRestore(item=want, restore_args=restore_args, partial_restore=True),
    ),
    keep=_PARAM_READ_HOOKS,
  )
  if error:  # truncated or missing array data
    raise CheckpointUnreadableError(f"checkpoint {root}/{step} is unreadable ({error})", step)
  try:
    record = read_record(os.path.join(root, str(step)))
  except CheckpointCorruptError:  # (no readable record: nothing to verify against)
    record = {}
  try:
    verify(record, out, f"checkpoint {root}/{step}")
  except CheckpointCorruptError as e:
    raise CheckpointUnreadableError(str(e), step) from None
  flat = {k[len("params|") :]: v for k, v in out.items()}
  return unflatten(abstract_params, flat), step


def _os_cause(text: str) -> str:
  """'No space left on device' from an error text carrying an errno (tensorstore's os_error_code=...,
  Python's [Errno N]), else ''."""
  m = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", text)
  return os.strerror(int(m[1] or m[2])) if m else ""


class Checkpointer:
  def __init__(self, directory: str, keep: int = 3, async_save: bool = True, keep_steps=()):
    self.directory = os.path.abspath(directory)
    # cleanup_tmp_directories: a save that failed (disk full) or was killed leaves <step>.orbax-checkpoint-tmp,
    # which a later save of the same step would trip over
    retention = {"max_to_keep": keep}
    if keep_steps:  # the newest `keep` and the listed steps
      retention = {
        "preservation_policy": preservation_policy.AnyPreservationPolicy(
          [preservation_policy.LatestN(keep), preservation_policy.CustomSteps(list(keep_steps))]
        )
      }
    opts = ocp.CheckpointManagerOptions(
      **retention,
      enable_async_checkpointing=async_save,
      create=True,
      cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(
      self.directory, options=opts, item_names=("state", "data", "record")
    )
    # hooks of failed restores, in place until close (orbax_noise.abandoned_reads_dropped)
    self._read_hooks = []
    orbax_noise.drop_unretrieved_save_tasks()
    self._held = orbax_noise.HeldBackSaveErrors()
    logging.getLogger("absl").addFilter(self._held)
    self._abandoned, self._previous_hook = [], sys.unraisablehook
    self._hook = sys.unraisablehook = orbax_noise.abandoned_writes_hook(
      sys.unraisablehook, self._abandoned
    )
    self._saving_step = None  # the step of the last save started (for the failure message)
    self.failed = None  # the CheckpointSaveError once a save has failed

  def latest_step(self):
    return self.manager.latest_step()

  def set_aside(self) -> list[str]:
    """The entries of ``<directory>.unreadable/``: checkpoints set aside by earlier runs, kept by hand."""
    dest = f"{self.directory}.unreadable"
    return sorted(os.listdir(dest)) if os.path.isdir(dest) else []

  def _set_aside(self, step: int, error: str):
    """Moves an unreadable checkpoint out of the way, keeping its files.

    It leaves ``directory`` (orbax would keep listing it as the latest step, and a later save of the same
    step would be skipped or refused) for ``<directory>.unreadable/<step>[.<time>]``, where it can be
    inspected or deleted by hand. Only process 0 moves files; every process then re-reads the step list."""
    dest = os.path.join(f"{self.directory}.unreadable", str(step))
    if os.path.exists(dest):
      dest = f"{dest}.{int(time.time())}"
    msg = (
      f"Checkpoint step {step} in {self.directory} is unreadable ({error}); "
      f"moved it to {dest} and falling back to the previous checkpoint"
    )
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), dest)
      print(msg, file=sys.stderr, flush=True)
    else:
      logging.warning(msg)
    if jax.process_count() > 1:  # the others must not list the step before process 0 has moved it
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      multihost_utils.sync_global_devices(f"kdn_set_aside_{step}")
    self.manager.reload()

  def latest_record(self):
    """(step, record) of the newest checkpoint whose record reads, or (None, None) without one."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        return step, self.record(step)
      except CheckpointCorruptError as e:  # its record does not read: set aside, try older
        self._set_aside(step, orbax_noise.describe(e))
    self._none_readable(steps)
    return None, None

  def check_fits(self, abstract_state):
    """Raises CheckpointMismatchError when a checkpoint holds another tree of arrays than
    ``abstract_state`` (another mixer, width, vocabulary: a changed config, not damage), before anything
    is restored, moved or written. Checkpoints whose metadata does not read are left to restore_latest."""
    want = flatten(abstract_state)
    for step in sorted(self.manager.all_steps(), reverse=True):
      state_dir = os.path.join(self.directory, str(step), "state")
      have, error = orbax_noise.quietly(lambda d=state_dir: _saved_shapes(d), keep=self._read_hooks)
      problems = "" if error else _misfit(have, want)
      if problems:
        raise CheckpointMismatchError(
          f"{self.directory}/{step} was saved by another model or config ({problems}); resume with "
          "the config it was trained with, or start a new --workdir (--config.train.init_from "
          "copies parameters)"
        )

  def restore_latest(self, abstract_state, data_iter):
    """(step, state, record) of the newest checkpoint that restores completely, or None without one.

    A checkpoint that fails to restore (truncated or missing files after a crash mid-write or a damaged
    disk) is set aside with a message and the next older one is tried: a resume never starts from a
    partial state. orbax itself writes each step to a temporary directory and renames it when complete,
    so a save interrupted by a kill is never listed as a step."""
    self.check_fits(abstract_state)  # a changed config moves nothing
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      found, error = orbax_noise.quietly(
        lambda s=step: self.restore(s, abstract_state, data_iter), keep=self._read_hooks
      )
      if error is None:
        return (step, *found)
      self._set_aside(step, error)
    self._none_readable(steps)
    return None

  def _none_readable(self, steps):
    """Every checkpoint failed: more likely a changed data pipeline than damage, so never restart from
    step 0 silently."""
    if steps:
      raise RuntimeError(
        f"none of the checkpoints {sorted(steps)} in {self.directory} restores; they were moved to "
        f"{self.directory}.unreadable/ (messages above). If the config changed, move them back and resume "
        "with the config they were saved with; otherwise delete them to start over"
      )

  def save(self, step: int, state, data_iter, record: dict, force: bool = False):
    """Saves (asynchronously unless configured otherwise) with the arrays' checksums in the record; a failed
    save, this one or the previous asynchronous one, raises CheckpointSaveError."""
    self.wait()  # the previous save (orbax waits for it anyway): its failure is named with its step
    flat = flatten(state)
    record = dict(
      record,
      checksums=array_checksum.checksums(flat),
      checksum=array_checksum.ALGORITHM,
      data_checksums=_data_checksums(data_iter),
    )
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(flat),
      data=grain.checkpoint.CheckpointSave(data_iter),
      record=ocp.args.JsonSave(record),
    )
    self._saving_step = step
    with self._save_errors():
      saved = self.manager.save(step, args=args, force=force)
    if saved:
      logging.info("checkpoint: saving step %d to %s", step, self.directory)
    return saved

  @contextlib.contextmanager
  def _save_errors(self):
    """Any failure inside (orbax's ValueErrors from tensorstore, OSErrors) -> CheckpointSaveError."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      self.failed = self._save_error(e)
      raise self.failed from None

  def _save_error(self, e: Exception) -> CheckpointSaveError:
    text = " ".join([str(e)] + self._held.held)
    cause = _os_cause(text) or (e.strerror if isinstance(e, OSError) and e.strerror else "")
    cause = cause or (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    done = (
      [s for s in ocp.utils.checkpoint_steps(self.directory) if s != self._saving_step]
      if os.path.isdir(self.directory)
      else []
    )
    last = (
      f"its last complete checkpoint is step {max(done)}"
      if done
      else "it holds no complete checkpoint"
    )
    disk = any(
      code in text
      for code in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), os.strerror(errno.EFBIG))
    )
    return CheckpointSaveError(
      f"saving step {self._saving_step} to {self.directory} failed: {cause}; training stopped and {last}: "
      f"{'free disk space, then ' if disk else ''}rerun the same command to resume"
    )

  def check(self):
    """Raises CheckpointSaveError when an asynchronous save has failed (cheap: call it at log points).
    (orbax's check_for_errors misses it: the manager's finalize thread takes the error first; waiting for a
    save that is no longer in progress returns at once, or raises its failure.)"""
    if self.failed is not None:
      raise self.failed
    if not self.manager.is_saving_in_progress():
      self.wait()

  def restore(self, step: int, abstract_state, data_iter):
    """Restores into ``abstract_state`` (ShapeDtypeStructs with shardings) and ``data_iter`` in place; arrays
    that fail their saved checksum raise CheckpointCorruptError."""
    abstract_flat = flatten(abstract_state)
    out = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_flat),
        data=grain.checkpoint.CheckpointRestore(data_iter),
        record=ocp.args.JsonRestore(),
      ),
    )
    record = dict(out["record"])
    verify(record, out["state"], f"{self.directory}/{step}")
    verify_data(record, data_iter, step, f"{self.directory}/{step}")
    return unflatten(abstract_state, out["state"]), out["record"]

  def record(self, step: int) -> dict:
    """The JSON record saved with ``step`` (reads nothing else); one that does not read is a
    CheckpointCorruptError naming its file."""
    try:
      return dict(
        self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
      )
    except Exception as e:  # pylint: disable=broad-except  (missing, truncated or not JSON)
      raise _record_error(os.path.join(self.directory, str(step)), e) from None

  def wait(self):
    if self.failed is not None:  # (orbax would raise the same failure again)
      return
    with self._save_errors():
      self.manager.wait_until_finished()

  def close(self):
    try:
      self.wait()
    finally:
      if self.failed is None:
        self.manager.close()
      orbax_noise.release_hooks(self._read_hooks)
      logging.getLogger("absl").removeFilter(self._held)
      if sys.unraisablehook is self._hook:
        sys.unraisablehook = self._previous_hook
      if self._abandoned:
        logging.info(
          "checkpoint: dropped %d abandoned writes of a failed save", len(self._abandoned)
        )
      if self._held.held and self.failed is None:  # held back, yet no save failed: say so
        logging.warning(
          "checkpoint: orbax reported an error: %s", self._held.held[0].splitlines()[0][:300]
        )
