"""orbax CheckpointManager wrapper: train state (params, optimizer, step, RNG, carried states, fitted-noise
statistics) + grain iterator state + a small JSON record; periodic and final saves, keep-N, async saves."""
from __future__ import annotations

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

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
