"""orbax CheckpointManager wrapper: train state (params, optimizer, step, RNG, carried states, fitted-noise
statistics) + grain iterator state + a small JSON record; periodic and final saves, keep-N, async saves.

The record carries a checksum of every array (array_checksum.py), verified after each restore: a checkpoint
whose arrays fail it is set aside like an unreadable one. A save that cannot be written (a full disk) raises
CheckpointSaveError with one line; orbax's own error logs of that save are held back, and the incomplete
step is never listed, so the workdir resumes from its last complete checkpoint."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import re
import shutil
import sys
import time

import grain
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from experiments.runner import array_checksum


def _is_abandoned_read(unraisable) -> bool:
  """A read callback scheduled on orbax's closed loop, or one of orbax's read coroutines closed
  unfinished by the garbage collector."""
  if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
    unraisable.exc_value
  ):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


@contextlib.contextmanager
def _abandoned_reads_dropped(settle_s: float = 0.3, max_wait_s: float = 3.0, keep=None):
  """Counts, instead of printing, the abandoned reads of a failed orbax restore.

  orbax reads a checkpoint's arrays concurrently on an asyncio loop. When one read of a damaged
  checkpoint fails, the restore raises and closes the loop while the other reads are in flight. Each
  of those then printed "Exception ignored ... Event loop is closed" (from tensorstore's threads) or
  an unfinished-coroutine traceback (from the garbage collector): about a hundred per damaged
  checkpoint. Inside the block they are counted; every other unraisable exception goes to the
  previous hook. The caller appends to the yielded list when its restore failed and handles the
  error inside the block (the error's traceback keeps the coroutines alive until it is dropped).
  After a failure the block's exit waits until no abandoned read has arrived for `settle_s` (at
  most `max_wait_s`) and logs the count in one line; a restore that succeeds is not delayed. With
  `keep` (a list) a failed block does not wait: it leaves its hook installed and appends (hook,
  previous hook, counts) to it, for _release_hooks to take out later (Checkpointer.close): stragglers can come
  after any quiet window on a loaded machine (a CI run got 21 past the 0.3 s one). The hook is
  process-wide: one restore at a time, as the runner does."""
  dropped, failed = [], []
  previous = sys.unraisablehook

  def hook(unraisable):
    if _is_abandoned_read(unraisable):
      dropped.append(time.monotonic())
    else:
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield failed
  finally:
    try:
      if failed and keep is None:  # (a kept hook keeps counting; close waits for stragglers)
        start = time.monotonic()
        gc.collect()
        while time.monotonic() - start < max_wait_s:
          time.sleep(settle_s / 3)
          gc.collect()
          if time.monotonic() - max(dropped, default=start) >= settle_s:
            break
    finally:
      if failed and keep is not None:
        keep.append((hook, previous, dropped))
      else:
        sys.unraisablehook = previous
        _log_dropped(dropped, failed)


def _log_dropped(dropped, failed):
  if dropped:
    # (a restore's hook also counts stragglers of an earlier failed one whose hook is kept)
    logging.info(
      "checkpoint: dropped %d abandoned reads during a %s restore",
      len(dropped),
      "failed" if failed else "successful",
    )


def _release_hooks(kept, settle_s: float = 1.0, max_wait_s: float = 5.0):
  """Takes out the hooks that failed restores left installed (newest first), once no abandoned
  read has arrived for `settle_s` (at most `max_wait_s`; a close right after a failed restore,
  e.g. when no checkpoint was readable, waits for the stragglers), the garbage collector's share
  collected."""
  if not kept:
    return
  start = time.monotonic()
  last = lambda: max((max(d, default=start) for _, _, d in kept), default=start)
  gc.collect()
  while time.monotonic() - start < max_wait_s and time.monotonic() - last() < settle_s:
    time.sleep(settle_s / 5)
    gc.collect()
  while kept:
    hook, previous, dropped = kept.pop()
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    _log_dropped(dropped, True)


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


class _DropMissingMetadata(logging.Filter):
  def filter(self, record):
    return "Metadata file does not exist" not in record.getMessage()


@contextlib.contextmanager
def _quiet_missing_metadata():
  log, filt = logging.getLogger("absl"), _DropMissingMetadata()
  log.addFilter(filt)
  try:
    yield
  finally:
    log.removeFilter(filt)


def _saved_shapes(state_dir: str) -> dict:
  """{flat key: shape} of a saved train state, read from its metadata only (no arrays)."""
  with (
    _quiet_missing_metadata()
  ):  # the step-level metadata file lives one level up: a harmless warning
    meta = ocp.PyTreeCheckpointer().metadata(state_dir)
  meta = getattr(meta, "item_metadata", meta)
  meta = getattr(meta, "tree", meta)
  return {k: tuple(getattr(v, "shape", ())) for k, v in dict(meta).items()}


def _misfit(have: dict, want: dict) -> str:
  """'' when every wanted array is saved with its shape, else a short list of the differences."""
  missing = [k for k in want if k not in have]
  wrong = [
    f"{k}: checkpoint {have[k]}, model {tuple(v.shape)}"
    for k, v in want.items()
    if k in have and have[k] != tuple(v.shape)
  ]
  if not missing and not wrong:
    return ""
  return f"{len(missing)} arrays missing, {len(wrong)} of another shape: " + "; ".join(
    [f"missing {k}" for k in missing[:5]] + wrong[:5]
  )


class CheckpointMismatchError(ValueError):
  """A readable checkpoint saved by another model or config (not damage: it is left in place)."""


class CheckpointCorruptError(ValueError):
  """A checkpoint whose restored arrays differ from the checksums saved with them."""


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (one line: the step, the directory, the cause, what to do)."""


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


def read_record(step_dir: str) -> dict:
  """The JSON record of one checkpoint step directory, read without a CheckpointManager (which would clean
  up the in-flight save of a run training in that directory)."""
  return dict(
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(step_dir, "record"))
  )


def restore_params(source: str, abstract_params) -> tuple[object, int]:
  """Restores only the parameters of another run's checkpoint into ``abstract_params`` (a pytree of
  ShapeDtypeStructs with shardings, the ``params`` of a train state); returns (params, step).

  Raises ValueError naming the first parameters that are missing or differ in shape, before reading
  any array."""
  root, step = find_checkpoint(source)
  state_dir = os.path.join(root, str(step), "state")
  want = {f"params|{k}": v for k, v in flatten(abstract_params).items()}
  try:
    have = _saved_shapes(state_dir)
  except Exception as e:  # pylint: disable=broad-except  (missing or damaged metadata)
    raise ValueError(
      f"checkpoint {root}/{step} is unreadable ({type(e).__name__}: "
      f"{(str(e).strip().splitlines() or [''])[0][:200]})"
    ) from None
  problems = _misfit(have, want)
  if problems:
    raise ValueError(f"checkpoint {root}/{step} does not fit this model ({problems})")
  restore_args = jax.tree.map(
    lambda v: ocp.ArrayRestoreArgs(sharding=v.sharding, dtype=v.dtype), want
  )
  out = ocp.PyTreeCheckpointer().restore(
    state_dir,
    args=ocp.args.PyTreeRestore(item=want, restore_args=restore_args, partial_restore=True),
  )
  try:
    record = read_record(os.path.join(root, str(step)))
  except Exception:  # pylint: disable=broad-except  (no readable record: nothing to verify against)
    record = {}
  verify(record, out, f"checkpoint {root}/{step}")
  flat = {k[len("params|") :]: v for k, v in out.items()}
  return unflatten(abstract_params, flat), step


def _os_cause(text: str) -> str:
  """'No space left on device' from an error text carrying an errno (tensorstore's os_error_code=...,
  Python's [Errno N]), else ''."""
  m = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", text)
  return os.strerror(int(m[1] or m[2])) if m else ""


class _HeldBackSaveErrors(logging.Filter):
  """Holds back orbax's ERROR logs (each with a traceback, from several threads per failed save) while a
  Checkpointer is open: the failure surfaces as one CheckpointSaveError instead. Kept for the message."""

  def __init__(self):
    super().__init__()
    self.held = []

  def filter(self, record):
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in (record.pathname or ""):
      self.held.append(record.getMessage())
      return False
    return True


def _abandoned_writes_hook(previous, dropped):
  """sys.unraisablehook that counts, instead of printing, what tensorstore's threads leave when a failed
  save's asyncio loop has closed under them (as _abandoned_reads_dropped does for a failed restore), and
  passes everything else on."""

  def hook(unraisable):
    if _is_abandoned_read(unraisable):
      dropped.append(time.monotonic())
    else:
      previous(unraisable)

  return hook


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
    self._read_hooks = []  # hooks of failed restores, in place until close (_abandoned_reads_dropped)
    self._held = _HeldBackSaveErrors()
    logging.getLogger("absl").addFilter(self._held)
    self._abandoned, self._previous_hook = [], sys.unraisablehook
    self._hook = sys.unraisablehook = _abandoned_writes_hook(sys.unraisablehook, self._abandoned)
    self._saving_step = None  # the step of the last save started (for the failure message)
    self.failed = None  # the CheckpointSaveError once a save has failed

  def latest_step(self):
    return self.manager.latest_step()

  def _set_aside(self, step: int, error: Exception):
    """Moves an unreadable checkpoint out of the way, keeping its files.

    It leaves ``directory`` (orbax would keep listing it as the latest step, and a later save of the same
    step would be skipped or refused) for ``<directory>.unreadable/<step>[.<time>]``, where it can be
    inspected or deleted by hand. Only process 0 moves files; every process then re-reads the step list."""
    dest = os.path.join(f"{self.directory}.unreadable", str(step))
    if os.path.exists(dest):
      dest = f"{dest}.{int(time.time())}"
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    msg = (
      f"Checkpoint step {step} in {self.directory} is unreadable ({type(error).__name__}: {first_line}); "
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
      except Exception as e:  # pylint: disable=broad-except  (any read failure: set aside, try older)
        self._set_aside(step, e)
    self._none_readable(steps)
    return None, None

  def restore_latest(self, abstract_state, data_iter):
    """(step, state, record) of the newest checkpoint that restores completely, or None without one.

    A checkpoint that fails to restore (truncated or missing files after a crash mid-write or a damaged
    disk) is set aside with a message and the next older one is tried: a resume never starts from a
    partial state. orbax itself writes each step to a temporary directory and renames it when complete,
    so a save interrupted by a kill is never listed as a step."""
    want = flatten(abstract_state)
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        problems = _misfit(_saved_shapes(os.path.join(self.directory, str(step), "state")), want)
      except Exception as e:  # pylint: disable=broad-except  (unreadable metadata: damaged)
        self._set_aside(step, e)
        continue
      if problems:  # a changed model or config, not damage: stop rather than set good files aside
        raise CheckpointMismatchError(
          f"{self.directory}/{step} was saved by another model or config ({problems}); resume with the "
          "config it was trained with, or start a new --workdir (--config.train.init_from copies parameters)"
        )
      with _abandoned_reads_dropped(keep=self._read_hooks) as failed:
        try:
          state, record = self.restore(step, abstract_state, data_iter)
          return step, state, record
        except Exception as e:  # pylint: disable=broad-except
          failed.append(step)
          self._set_aside(step, e)
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
      record, checksums=array_checksum.checksums(flat), checksum=array_checksum.ALGORITHM
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
    verify(dict(out["record"]), out["state"], f"{self.directory}/{step}")
    return unflatten(abstract_state, out["state"]), out["record"]

  def record(self, step: int) -> dict:
    """The JSON record saved with ``step`` (reads nothing else)."""
    return dict(
      self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
    )

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
      _release_hooks(self._read_hooks)
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
