"""orbax CheckpointManager wrapper: train state (params, optimizer, step, RNG, carried states, fitted-noise
statistics) + grain iterator state + a small JSON record; periodic and final saves, keep-N, async saves."""
from __future__ import annotations

import contextlib
import logging
import os

import grain
import jax
import orbax.checkpoint as ocp


def _key_str(k) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flatten(tree) -> dict:
  """{'a|b|0': leaf} for every array leaf (None subtrees vanish)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'|'.join(_key_str(k) for k in path): leaf for path, leaf in leaves}


def unflatten(template, flat: dict):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  return jax.tree_util.tree_unflatten(
      treedef, [flat['|'.join(_key_str(k) for k in path)] for path, _ in leaves])


def find_checkpoint(source: str) -> tuple[str, int]:
  """(checkpoints directory, step) of ``source``: a run's workdir (its latest checkpoint), its
  ``checkpoints`` directory, or one step directory ``.../checkpoints/<step>``."""
  source = os.path.abspath(source)
  if not os.path.isdir(source):
    raise FileNotFoundError(f'no such directory: {source!r}')
  base = os.path.basename(source.rstrip('/'))
  if base.isdigit() and os.path.isdir(os.path.join(source, 'state')):
    return os.path.dirname(source), int(base)
  root = os.path.join(source, 'checkpoints')
  root = root if os.path.isdir(root) else source
  steps = ocp.utils.checkpoint_steps(root) if os.path.isdir(root) else []
  if not steps:
    raise FileNotFoundError(f'no checkpoint in {source!r} (expected <workdir>/checkpoints/<step>)')
  return root, max(steps)


class _DropMissingMetadata(logging.Filter):
  def filter(self, record):
    return 'Metadata file does not exist' not in record.getMessage()


@contextlib.contextmanager
def _quiet_missing_metadata():
  log, filt = logging.getLogger('absl'), _DropMissingMetadata()
  log.addFilter(filt)
  try:
    yield
  finally:
    log.removeFilter(filt)


def restore_params(source: str, abstract_params) -> tuple[object, int]:
  """Restores only the parameters of another run's checkpoint into ``abstract_params`` (a pytree of
  ShapeDtypeStructs with shardings, the ``params`` of a train state); returns (params, step).

  Raises ValueError naming the first parameters that are missing or differ in shape, before reading
  any array."""
  root, step = find_checkpoint(source)
  state_dir = os.path.join(root, str(step), 'state')
  want = {f'params|{k}': v for k, v in flatten(abstract_params).items()}
  with _quiet_missing_metadata():  # the step-level metadata file lives one level up: a harmless warning
    meta = ocp.PyTreeCheckpointer().metadata(state_dir)
  meta = getattr(meta, 'item_metadata', meta)
  meta = getattr(meta, 'tree', meta)
  have = {k: tuple(getattr(v, 'shape', ())) for k, v in dict(meta).items()}
  missing = [k for k in want if k not in have]
  wrong = [f'{k}: checkpoint {have[k]}, model {tuple(v.shape)}' for k, v in want.items()
           if k in have and have[k] != tuple(v.shape)]
  if missing or wrong:
    problems = [f'missing {k}' for k in missing[:5]] + wrong[:5]
    raise ValueError(f'checkpoint {root}/{step} does not fit this model '
                     f'({len(missing)} parameters missing, {len(wrong)} of another shape): ' + '; '.join(problems))
  restore_args = jax.tree.map(lambda v: ocp.ArrayRestoreArgs(sharding=v.sharding, dtype=v.dtype), want)
  out = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
      item=want, restore_args=restore_args, partial_restore=True))
  flat = {k[len('params|'):]: v for k, v in out.items()}
  return unflatten(abstract_params, flat), step


class Checkpointer:

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                        create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=opts,
                                         item_names=('state', 'data', 'record'))

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step: int, state, data_iter, record: dict, force: bool = False):
    args = ocp.args.Composite(state=ocp.args.StandardSave(flatten(state)),
                              data=grain.checkpoint.CheckpointSave(data_iter),
                              record=ocp.args.JsonSave(record))
    saved = self.manager.save(step, args=args, force=force)
    if saved:
      logging.info('checkpoint: saving step %d to %s', step, self.directory)
    return saved

  def restore(self, step: int, abstract_state, data_iter):
    """Restores into ``abstract_state`` (ShapeDtypeStructs with shardings) and ``data_iter`` in place."""
    abstract_flat = flatten(abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_flat),
        data=grain.checkpoint.CheckpointRestore(data_iter),
        record=ocp.args.JsonRestore()))
    return unflatten(abstract_state, out['state']), out['record']

  def record(self, step: int) -> dict:
    """The JSON record saved with ``step`` (reads nothing else)."""
    return dict(self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))['record'])

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
