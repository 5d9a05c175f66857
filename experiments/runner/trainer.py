"""The Trainer behind ``experiments/train.py``.

``Trainer(config, workdir).run()`` builds the mesh, model, optimizer and data, restores the latest checkpoint
in ``workdir/checkpoints`` if there is one, trains, evaluates from the model's normal initial state, and
writes metrics, a summary and a loss curve.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import config_checks, kernel_config, schema
from experiments.data import pipeline
from experiments.runner import checkpoint as ckpt_lib
from experiments.runner import initial_states as init_lib
from experiments.runner import optim, sharding, workdir_lock
from experiments.runner.loss import check_dropped, cross_entropy, scored_logits
from experiments.runner.train_loop import TrainLoop
from kdn_jax.models import config as model_config_lib
from kdn_jax.ops import dispatch


def _is_var(x):
  return isinstance(x, nnx.Variable)


def _pure_from_state(state, fn):
  """Nested plain dict (like nnx.to_pure_dict) of ``fn(variable)`` for an nnx.State of Variables."""
  out = {}
  for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]:
    node = out
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = fn(var)
  return out


def _host_init(init, shardings):
  """Runs ``init`` op by op on the host CPU, then lays the values out with ``shardings``.

  One jit of a whole model's initialisers compiles a separate random-number kernel per parameter
  (measured: 112 s on an H200 and 19 s on CPU for the 125M LM); op by op, identical layers reuse
  compiled kernels (5 s on CPU). Every process computes the same values from the seed and keeps
  only its shards, so this also works across hosts. Without a CPU backend it falls back to jit.
  """
  try:
    cpu = jax.local_devices(backend="cpu")[0]  # this process's CPU (jax.devices lists all hosts')
  except RuntimeError:
    return jax.jit(init, out_shardings=shardings)()
  with jax.default_device(cpu):
    values = jax.device_get(init())
  return jax.tree.map(
    lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx]), values, shardings
  )


class Trainer(TrainLoop):
  """A run's mesh, model, optimizer state, data, jitted steps and checkpoints; ``run`` (the loop, with
  its reporting) is TrainLoop's (experiments/runner/train_loop.py)."""

  peak_lr = (
    None  # the optimizer's peak rate; None: config.optim.learning_rate (a sweep trains at 1)
  )

  def __init__(self, config, workdir: str, devices=None):
    sharding.maybe_initialize_distributed(config)
    self.devices = list(jax.devices() if devices is None else devices)
    self.process_index, self.process_count = jax.process_index(), jax.process_count()
    config_checks.check(config)  # (a no-op for a config train.py checked)
    mesh_shape = schema.check_mesh(config, len(self.devices), self.process_count)
    if "mlp_matched" in config.model:  # flag overrides of the mixer keep parameters matched
      model_config_lib.resolve_mlp_hidden(config.model)
    self.config, self.workdir = config, workdir
    self.is_main = self.process_index == 0
    self._lock, self.checkpointer = None, None
    self._lock_workdir(workdir)
    try:
      dispatch.warm_kernel_imports()
      self.mesh = sharding.make_mesh(mesh_shape, self.devices)
      self.strategy = config.train.initial_state
      self._stop_requested = False
      self._build_model()
      self._build_state()
      self._build_steps()
      self.data_iter = self._train_iterator()
      self.eval_batches = self._eval_batches()
      if config.checkpoint.enabled:
        self.checkpointer = ckpt_lib.Checkpointer(
          os.path.join(workdir, "checkpoints"),
          config.checkpoint.keep,
          config.checkpoint.async_save,
          schema.parse_keep_steps(schema.setting(config, "checkpoint.keep_steps")),
        )
      self.config_json = json.loads(config.to_json_best_effort())
      self.init_from_step = None
      self._note_set_aside()
      self._resume_step = self._check_resumable()
      if self._resume_step is None and config.train.init_from:
        self._init_from(config.train.init_from)
    except BaseException:  # a failed start leaves the workdir as it was
      self._abandon_start()
      raise
    if self.checks_fit_at_init:
      self._check_fits()
    self.last_metrics = {}

  # whether __init__'s state is the one checkpoints hold (a sweep stacks its members' afterwards)
  checks_fit_at_init = True

  def _check_fits(self):
    """A workdir's checkpoint of another model or config is refused before anything is moved or
    written (after the named checks of _check_resumable)."""
    if self._resume_step is None:
      return
    try:
      self.checkpointer.check_fits(self.abstract_state())
    except BaseException:
      self._abandon_start()
      raise

  def _abandon_start(self):
    try:
      if self.checkpointer is not None:
        self.checkpointer.close()
    finally:
      workdir_lock.release(self._lock)

  def _lock_workdir(self, workdir: str):
    """One run per workdir (workdir_lock.py): process 0 takes the lock and tells the others."""
    error = None
    if self.is_main:
      try:
        self._lock = workdir_lock.acquire(workdir)
      except workdir_lock.WorkdirInUseError as e:
        error = e
    else:
      os.makedirs(workdir, exist_ok=True)
    if self.process_count > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
      if not ok and error is None:
        error = workdir_lock.WorkdirInUseError(
          f"{workdir} is in use by another run (process 0 found its lock)"
        )
    if error is not None:
      raise error

  # ---------------------------------------------------------------- model
  def _build_model(self):
    cfg = self.config
    cls = schema.import_object(cfg.model_factory)
    model_cfg = cfg.model
    self._model_cls = cls

    # config.kernels: the kernels' configs the model passes down to its ops
    kernels = kernel_config.model_kwargs(cfg)

    def make(seed=cfg.seed):
      with nnx.use_eager_sharding(False):
        return cls(model_cfg, rngs=nnx.Rngs(seed), **kernels)

    abs_model = nnx.eval_shape(make)
    self.graphdef, self.abs_params, self.abs_rest = nnx.split(abs_model, nnx.Param, ...)
    rules = dict(cfg.mesh.rules)
    self.param_shardings = _pure_from_state(
      self.abs_params,
      lambda v: jax.sharding.NamedSharding(
        self.mesh,
        sharding.spec_for(v.get_value().shape, sharding.logical_names(v), rules, self.mesh),
      ),
    )
    rest_sh = jax.tree.map(
      lambda _: sharding.replicated(self.mesh), nnx.to_pure_dict(self.abs_rest)
    )

    def init(seed):
      m = make(seed)
      _, p, r = nnx.split(m, nnx.Param, ...)
      return nnx.to_pure_dict(p), nnx.to_pure_dict(r)

    out_sh = (self.param_shardings, rest_sh)
    # (params, rest) initialised from a seed (a sweep over seeds initialises one set per seed)
    self._init_for_seed = lambda seed: _host_init(functools.partial(init, seed), out_sh)
    self._init_fn = functools.partial(self._init_for_seed, cfg.seed)
    self.num_params = sum(
      int(np.prod(v.get_value().shape)) for v in jax.tree.leaves(self.abs_params, is_leaf=_is_var)
    )

  def merge(self, params, rest=None):
    """An nnx model from pure-dict params (usable inside jit)."""
    p = jax.tree.map(lambda x: x, self.abs_params)
    nnx.replace_by_pure_dict(p, params)
    r = jax.tree.map(lambda x: x, self.abs_rest)
    if rest:
      nnx.replace_by_pure_dict(r, rest)
    return nnx.merge(self.graphdef, p, r)

  # ---------------------------------------------------------------- data (a sweep over seeds overrides)
  def _train_iterator(self):
    return pipeline.make_train_iterator(self.config, self.process_index, self.process_count)

  def _eval_batches(self) -> list[dict]:
    return pipeline.make_eval_batches(self.config, self.process_index, self.process_count)

  # ---------------------------------------------------------------- state
  def _build_state(self):
    cfg = self.config
    params, self.rest = self._init_fn()
    self.tx = optim.make_optimizer(cfg, params, self.peak_lr)
    abs_opt = jax.eval_shape(self.tx.init, params)
    rep = sharding.replicated(self.mesh)
    opt_sh = optax.tree_map_params(
      self.tx, lambda _, s: s, abs_opt, self.param_shardings, transform_non_params=lambda _: rep
    )
    opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(params)
    batch = cfg.data.global_batch_size

    abs_default = jax.eval_shape(lambda p: self.merge(p, self.rest).init_states(batch), params)
    carry, carry_sh = None, None
    if self.strategy in init_lib.CARRY_STRATEGIES:
      carry_sh = sharding.leading_batch_shardings(abs_default, self.mesh)
      carry = jax.jit(
        lambda p: self.merge(p, self.rest).init_states(batch), out_shardings=carry_sh
      )(params)
    fstats = None
    if self.strategy == "fitted_noise":
      fstats = jax.device_put(init_lib.init_fitted_stats(abs_default), rep)
    self.state = {
      "params": params,
      "opt_state": opt_state,
      "step": jax.device_put(jnp.zeros((), jnp.int32), rep),
      "rng": jax.device_put(jax.random.PRNGKey(cfg.seed), rep),
      "carry": carry,
      "carry_valid": jax.device_put(jnp.zeros((), bool), rep),
      "fstats": fstats,
    }
    self.state_shardings = {
      "params": self.param_shardings,
      "opt_state": opt_sh,
      "step": rep,
      "rng": rep,
      "carry": carry_sh,
      "carry_valid": rep,
      "fstats": None if fstats is None else jax.tree.map(lambda _: rep, fstats),
    }

  def _note_set_aside(self):
    """Says when earlier runs set checkpoints aside (a run resumes without them, or from step 0)."""
    if self.checkpointer is None or not self.is_main:
      return
    names = self.checkpointer.set_aside()
    if names:
      print(
        f"Note: {len(names)} checkpoint(s) set aside as unreadable by an earlier run are in "
        f"{self.checkpointer.directory}.unreadable/ ({', '.join(names)}); this run does not use "
        "them: inspect them, then delete them or move sound ones back",
        flush=True,
      )

  def _note_seed(self, step: int, record: dict):
    """Says once (the checkpoint saves the new values) when a resume names other seeds: the parameters
    and random state continue from the checkpoint; a data seed changes the data from here on."""
    saved = record.get("config") or {}
    for key, now, was, effect in (
      (
        "seed",
        self.config.seed,
        saved.get("seed"),
        "parameters and random state continue from the checkpoint; this seed is not used",
      ),
      (
        "data.shuffle_seed",
        self.config.data.shuffle_seed,
        (saved.get("data") or {}).get("shuffle_seed"),
        "the data from here on follows the new seed",
      ),
    ):
      if was is not None and now != was and self.is_main:
        print(
          f"Note: config.{key}={now} differs from {was}, the value {self.workdir} was trained with "
          f"(step {step}): {effect}",
          flush=True,
        )

  def _check_resumable(self):
    """The step this workdir resumes from (None: a new run). A checkpoint of another model or config, or
    written under another initial-state strategy (its carried state differs), is refused before
    anything is moved or written: that needs the run's own config or a new run."""
    if self.checkpointer is None:
      return None
    step, record = self.checkpointer.latest_record()  # an unreadable latest one is set aside
    if step is None:
      return None
    self.init_from_step = record.get(
      "init_from_step"
    )  # a resumed post-training run keeps its origin
    saved = record.get("initial_state", self.strategy)
    if saved != self.strategy:
      raise schema.ConfigError(
        f"config.train.initial_state: {self.workdir} holds a run trained with initial_state={saved!r} "
        f"(step {step}); to continue it with {self.strategy!r} start a new workdir with "
        f"--config.train.init_from={self.workdir}"
      )
    self._note_seed(step, record)
    return step

  def _init_from(self, source):
    """Post-training: parameters from another run's checkpoint; optimizer, step and RNG start fresh."""
    abs_params = self.abstract_state()["params"]
    try:
      params, step = ckpt_lib.restore_params(source, abs_params)
    except (FileNotFoundError, ValueError) as e:
      raise schema.ConfigError(f"config.train.init_from: {e}") from e
    self.state["params"] = params
    self.init_from_step = step
    if self.is_main:
      print(
        f"Initialised parameters from {source} (step {step}); fresh optimizer, "
        f"initial_state={self.strategy}",
        flush=True,
      )

  def abstract_state(self):
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      self.state,
      self.state_shardings,
    )

  # ---------------------------------------------------------------- steps
  def _loss_fn(self, params, rest, batch, state, key):
    cfg = self.config
    model = self.merge(params, rest)
    b = batch["inputs"].shape[0]
    reset = None
    if self.strategy == "zero":
      init = None
    else:
      default = model.init_states(b)
      tbtt_reset = batch.get("reset")
      first = jnp.logical_not(state["carry_valid"])
      if self.strategy in init_lib.CARRY_STRATEGIES:
        tbtt_reset = first | (tbtt_reset if tbtt_reset is not None else jnp.zeros((b,), bool))
      init, reset = init_lib.initial_states(
        self.strategy,
        default,
        key=key,
        carry=state["carry"],
        reset=tbtt_reset,
        stats=state["fstats"],
        sigma=cfg.train.noise_std,
        reset_prob=cfg.train.state_reset_prob,
      )
    logits, final, targets, mask, dropped = scored_logits(
      model, batch, cfg.train.loss_positions, states=init
    )
    nll, correct, count = cross_entropy(logits, targets, mask, cfg.train.z_loss)
    denom = jnp.maximum(count, 1.0)
    aux = {
      "final": jax.lax.stop_gradient(final),
      "reset": reset,
      "accuracy": correct / denom,
      "tokens": count,
      "dropped": dropped,
    }
    return nll / denom, aux

  def _train_step(self, state, rest, batch, lr_scale=None):
    """One optimizer step. ``lr_scale`` multiplies the update (the optimizer is linear in its peak rate, so
    a unit-rate optimizer scaled by ``lr`` is the optimizer at rate ``lr``: how a sweep vmaps rates)."""
    cfg = self.config
    key = jax.random.fold_in(state["rng"], state["step"])
    (loss, aux), grads = jax.value_and_grad(self._loss_fn, has_aux=True)(
      state["params"], rest, batch, state, key
    )
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    lr = optim.schedule(cfg, self.peak_lr)(state["step"])
    if lr_scale is not None:
      updates = jax.tree.map(lambda u: (u * lr_scale).astype(u.dtype), updates)
      lr = lr * lr_scale
    params = optax.apply_updates(state["params"], updates)
    gnorm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    new = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
    if self.strategy in init_lib.CARRY_STRATEGIES:
      new["carry"] = jax.tree.map(lambda f, c: f.astype(c.dtype), aux["final"], state["carry"])
      new["carry_valid"] = jnp.ones((), bool)
    if self.strategy == "fitted_noise":
      new["fstats"] = init_lib.update_fitted_stats(
        state["fstats"], aux["final"], cfg.train.fitted_noise_beta
      )
    if cfg.train.nan_policy == "skip":
      keep_step = new["step"]
      new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
      new["step"] = keep_step
    metrics = {
      "loss": loss,
      "accuracy": aux["accuracy"],
      "grad_norm": gnorm,
      "dropped_targets": aux["dropped"],
      "lr": lr,
      "finite": ok.astype(jnp.float32),
    }
    if aux["reset"] is not None:
      metrics["reset_frac"] = jnp.mean(aux["reset"].astype(jnp.float32))
    return new, metrics, aux["reset"]

  def _eval_step(self, params, rest, batch):
    model = self.merge(params, rest)
    # always the model's normal initial state
    logits, _, targets, mask, dropped = scored_logits(
      model, batch, self.config.train.loss_positions
    )
    return (*cross_entropy(logits, targets, mask), dropped)

  def _build_steps(self):
    rep = sharding.replicated(self.mesh)
    rest_sh = jax.tree.map(lambda _: rep, self.rest)
    # Traced with the recurrent ops splitting T over mesh.context (a no-op when it is 1).
    self._train_step_jit = sharding.traced_context_parallel(
      self.mesh,
      jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, rest_sh, None),
        out_shardings=(self.state_shardings, rep, None),
        donate_argnums=(0,),
      ),
    )
    self._eval_step_jit = sharding.traced_context_parallel(
      self.mesh,
      jax.jit(
        self._eval_step, in_shardings=(self.param_shardings, rest_sh, None), out_shardings=rep
      ),
    )

  def _global_batch(self, local_batch: dict) -> dict:
    return sharding.global_batch(local_batch, self.mesh)

  def train_step(self, local_batch: dict):
    """One step on a per-process numpy batch; returns host metrics."""
    batch = self._global_batch(local_batch)
    with _null():
      self.state, metrics, reset = self._train_step_jit(self.state, self.rest, batch)
    self.last_reset = reset
    return metrics

  def evaluate(self) -> dict:
    """Validation loss, accuracy and perplexity over the fixed batches (a sweep: arrays over its members)."""
    tot = sum(
      np.asarray(
        jax.device_get(self._eval_step_jit(self.state["params"], self.rest, self._global_batch(b))),
        np.float64,
      )
      for b in self.eval_batches
    )  # (nll, correct, count, dropped)[, members]
    check_dropped(self.config, tot[3], "validation")
    loss = tot[0] / np.maximum(tot[2], 1.0)
    out = {
      "loss": loss,
      "accuracy": tot[1] / np.maximum(tot[2], 1.0),
      "perplexity": np.exp(np.minimum(loss, 50)),
    }
    return {k: float(v) if np.ndim(v) == 0 else v for k, v in out.items()}

  # ---------------------------------------------------------------- checkpoints
  def step(self) -> int:
    return int(self.state["step"])

  def save(self, force=False):
    if self.checkpointer is None:
      return
    step = self.step()
    if self.checkpointer.latest_step() == step:
      return
    record = {
      "step": step,
      "metrics": {k: np.asarray(v).tolist() for k, v in self.last_metrics.items()},
      "initial_state": self.strategy,
      "init_from": self.config.train.init_from,
      "init_from_step": self.init_from_step,
      "config": self.config_json,
    }
    self.checkpointer.save(step, self.state, self.data_iter, record, force=force)

  def maybe_restore(self) -> bool:
    if self.checkpointer is None:
      return False
    found = self.checkpointer.restore_latest(self.abstract_state(), self.data_iter)
    if found is None:
      return False
    step, self.state, _ = found
    logging.info("restored checkpoint at step %d", step)
    if self.is_main:
      print(f"Resumed from checkpoint at step {step}", flush=True)
    return True

  def close(self):
    try:
      if self.checkpointer is not None:
        self.checkpointer.close()
      close = getattr(self.data_iter, "close", None)
      if close:
        close()
    finally:
      workdir_lock.release(self._lock)
      self._lock = None


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False
