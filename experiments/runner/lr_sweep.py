"""Several learning rates (and seeds) of one config trained in one process: ``config.train.lr_sweep``,
``config.train.seeds``.

    python -m experiments.train --config=configs/mqar.py:smoke,kda \\
        --config.train.lr_sweep=1e-3,3e-3,1e-2 --workdir=/tmp/mqar_sweep
    python -m experiments.train --config=configs/mqar_zoology.py:d64,kda \\
        --config.train.lr_sweep=1e-3,1e-2 --config.train.seeds=0,1,2 --workdir=/tmp/zoology/d64/kda

The members are every (rate, seed) pair; their states are stacked on a leading axis and one jitted step is
vmapped over them. A small model leaves an accelerator mostly idle (its step is bound by kernel launches,
not arithmetic), so N members in one program cost little more than one, where N processes sharing the device
are time-sliced one after another. Without ``seeds`` every member starts from the parameters of
``config.seed`` and sees the same batches. With ``seeds`` the member of seed s trains as the single run with
``--config.seed=s --config.data.shuffle_seed=s`` would: its own initial parameters, noise and data order
(one data stream per seed, stacked [S, B, ...] and picked per member inside the step); with
``train.init_from`` every member starts from those parameters instead.

The optimizer is built at peak rate 1 and each member's update is multiplied by its rate: AdamW's update
(decoupled weight decay included) is proportional to the peak rate, so member ``lr`` trains as a run at
``--config.optim.learning_rate=lr`` would (to float rounding).

The workdir holds the stacked checkpoints (resume as usual) and one folder per member, ``lr<rate>/`` or
``lr<rate>_seed<seed>/`` (``schema.sweep_member_dir``), laid out as a plain run: ``config.json`` (that
member's rate and seed, no sweep), ``metrics.jsonl``, ``summary.json``, ``loss.png`` and the member's final
checkpoint, so ``evaluate`` and ``init_from`` take a member like any run. A member whose loss or gradients
turn non-finite is frozen and reported ``diverged`` (the others go on; under ``nan_policy='halt'`` the sweep
halts only when all have).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import schema
from experiments.data import pipeline
from experiments.runner import checkpoint as ckpt_lib
from experiments.runner import initial_states as init_lib
from experiments.runner import logging_utils, sharding, train_loop
from experiments.runner import trainer as trainer_lib


def _stacked_sharding(sh):
  return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))


class _MemberWriters:
  """Fans metrics with a leading member axis out to one MetricWriter per member folder."""

  def __init__(self, dirs, tensorboard, active, resume_step):
    self.writers = [
      logging_utils.MetricWriter(d, tensorboard, active, resume_step=resume_step) for d in dirs
    ]

  def write(self, step, split, metrics):
    for i, w in enumerate(self.writers):
      w.write(
        step,
        split,
        {k: np.asarray(v).reshape(-1)[i] if np.ndim(v) else v for k, v in metrics.items()},
      )

  def close(self):
    for w in self.writers:
      w.close()


class _SeedStreams:
  """One training iterator per seed, batches stacked [S, B, ...]; checkpointed as one iterator (grain's
  checkpoint handler saves ``get_state()`` bytes and calls ``set_state`` / ``start_prefetch``)."""

  def __init__(self, iterators):
    self.iterators = list(iterators)

  def __iter__(self):
    return self

  def __next__(self):
    batches = [next(it) for it in self.iterators]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}

  def get_state(self) -> bytes:
    return json.dumps([it.get_state() for it in self.iterators]).encode()

  def set_state(self, state: bytes):
    states = json.loads(state.decode() if isinstance(state, bytes) else state)
    if len(states) != len(self.iterators):
      raise ValueError(
        f"the checkpoint holds {len(states)} data streams, this sweep has {len(self.iterators)} seeds"
      )
    for it, st in zip(self.iterators, states):
      it.set_state(st)

  def start_prefetch(self):
    for it in self.iterators:
      if hasattr(it, "start_prefetch"):
        it.start_prefetch()

  def close(self):
    for it in self.iterators:
      if hasattr(it, "close"):
        it.close()


def seed_config(config, seed: int):
  """The config of the single run a sweep member of ``seed`` trains as (its parameters' and data's seed)."""
  c = config.copy_and_resolve_references()
  c.seed = int(seed)
  c.data.shuffle_seed = int(seed)
  return c


class SweepTrainer(trainer_lib.Trainer):
  """``Trainer`` over ``config.train.lr_sweep`` x ``config.train.seeds``: state, steps and records per member
  (``evaluate`` is the base's over the vmapped evaluation step)."""

  peak_lr = 1.0
  checks_fit_at_init = False  # the members' stacked state is built below

  def __init__(self, config, workdir: str, devices=None):
    self.lrs = tuple(float(lr) for lr in config.train.lr_sweep) or (
      float(config.optim.learning_rate),
    )
    self.seeds = schema.parse_seeds(schema.setting(config, "train.seeds"))
    self.seeded = bool(self.seeds)
    seeds = self.seeds or (int(config.seed),)
    self.members = [(lr, s) for lr in self.lrs for s in seeds]  # rate-major: lr0 s0, lr0 s1, ...
    self.labels = [f"{lr:g}" + (f"/s{s}" if self.seeded else "") for lr, s in self.members]
    self.flops_members = len(self.members)  # every member trains on each token of the batch
    self.member_dirs = [
      schema.sweep_member_dir(workdir, lr, s if self.seeded else None) for lr, s in self.members
    ]
    super().__init__(config, workdir, devices)  # one member's state (and init_from), stacked below
    rep = sharding.replicated(self.mesh)
    by_seed = {int(config.seed): self.state}
    if self.seeded and not config.train.init_from:
      for s in seeds:
        if s not in by_seed:
          by_seed[s] = self._seed_state(s)
    # (with init_from every member starts from those parameters; its seed still sets its noise and data)
    per_member = [
      dict(by_seed.get(s, self.state), rng=jax.random.PRNGKey(s)) for _, s in self.members
    ]
    self.state = {
      k: None if v is None else jax.tree.map(lambda *xs: jnp.stack(xs), *[m[k] for m in per_member])
      for k, v in self.state.items()
    }
    self.state["alive"] = jnp.ones((len(self.members),), bool)
    self.state_shardings = {
      k: None if v is None else jax.tree.map(_stacked_sharding, v)
      for k, v in self.state_shardings.items()
    }
    self.state_shardings["alive"] = rep
    self.state = jax.device_put(self.state, self.state_shardings)
    self.lr_array = jax.device_put(jnp.asarray([lr for lr, _ in self.members], jnp.float32), rep)
    self.seed_index = jax.device_put(
      jnp.asarray([seeds.index(s) for _, s in self.members], jnp.int32), rep
    )
    self.diverged = {}  # member index -> first non-finite step
    self._check_fits()
    self._build_sweep_steps()

  def _seed_state(self, seed: int) -> dict:
    """A fresh single-run state (parameters, optimizer, RNG, carried states) from ``seed``."""
    params, _ = self._init_for_seed(seed)
    state = dict(
      self.state, params=params, opt_state=self.tx.init(params), rng=jax.random.PRNGKey(seed)
    )
    if self.strategy in init_lib.CARRY_STRATEGIES:
      batch = self.config.data.global_batch_size
      state["carry"] = jax.jit(lambda p: self.merge(p, self.rest).init_states(batch))(params)
    return state

  # ---------------------------------------------------------------- data
  def _train_iterator(self):
    if not self.seeded:
      return super()._train_iterator()
    return _SeedStreams(
      pipeline.make_train_iterator(
        seed_config(self.config, s), self.process_index, self.process_count
      )
      for s in self.seeds
    )

  def _eval_batches(self) -> list[dict]:
    if not self.seeded:
      return super()._eval_batches()
    per_seed = [
      pipeline.make_eval_batches(
        seed_config(self.config, s), self.process_index, self.process_count
      )
      for s in self.seeds
    ]
    return [
      {k: np.stack([b[k] for b in batches]) for k in batches[0]} for batches in zip(*per_seed)
    ]

  def _global_batch(self, local_batch: dict) -> dict:
    """Seeded batches are [S, B, ...]: B over the batch axes, as one run's."""
    if not self.seeded:
      return super()._global_batch(local_batch)
    return {
      k: jax.make_array_from_process_local_data(
        _stacked_sharding(sharding.sequence_batch_sharding(self.mesh, v.ndim - 1)), v
      )
      for k, v in local_batch.items()
    }

  # ---------------------------------------------------------------- steps
  def _build_steps(self):
    pass  # built once the state is stacked (_build_sweep_steps)

  def _member_step(self, state, rest, batch, lr):
    """One member's step; a member that is (or turns) non-finite keeps its last finite state."""
    inner = {k: v for k, v in state.items() if k != "alive"}
    new, metrics, reset = self._train_step(inner, rest, batch, lr_scale=lr)
    ok = (metrics["finite"] > 0) & state["alive"]
    new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, inner)
    new["step"] = inner["step"] + 1  # every member stays on the shared data stream
    new["alive"] = ok if self.config.train.nan_policy == "halt" else state["alive"]
    return new, metrics, reset

  def _pick(self, batch, seed_index):
    """The member's batch: its seed's stream in a seeded sweep, else the shared one."""
    return jax.tree.map(lambda x: x[seed_index], batch) if self.seeded else batch

  def _build_sweep_steps(self):
    rep = sharding.replicated(self.mesh)
    rest_sh = jax.tree.map(lambda _: rep, self.rest)
    member_param_sh = jax.tree.map(_stacked_sharding, self.param_shardings)
    step = jax.vmap(
      lambda state, rest, batch, lr, si: self._member_step(state, rest, self._pick(batch, si), lr),
      in_axes=(0, None, None, 0, 0),
    )
    self._train_step_jit = sharding.traced_context_parallel(
      self.mesh,
      jax.jit(
        lambda state, rest, batch: step(state, rest, batch, self.lr_array, self.seed_index),
        in_shardings=(self.state_shardings, rest_sh, None),
        out_shardings=(self.state_shardings, rep, None),
        donate_argnums=(0,),
      ),
    )
    # Members evaluated one after another (lax.map): an evaluation batch is often larger than a training
    # one, and N members' logits at once are what runs out of memory first (seen: 4.3 GiB at vocab 8192).
    evaluate = lambda params, rest, batch: (
      jax.lax.map(
        lambda a: jnp.stack(self._eval_step(a[0], rest, self._pick(batch, a[1]))),
        (params, self.seed_index),
      ).T
    )  # [4 totals, members]
    self._eval_step_jit = sharding.traced_context_parallel(
      self.mesh, jax.jit(evaluate, in_shardings=(member_param_sh, rest_sh, None), out_shardings=rep)
    )

  def _check_finite(self, pending):
    """Records members that turned non-finite; halts (like one run) only when every member has."""
    if not pending:
      return
    flags = np.asarray(jax.device_get([f for _, f in pending]))  # [checks, members]
    for (step, _), row in zip(pending, flags):
      for i in np.flatnonzero(row == 0):
        if i not in self.diverged:
          self.diverged[int(i)] = step
          if self.is_main:
            print(
              f"lr {self.labels[i]}: non-finite loss/gradients at step {step}; member frozen",
              flush=True,
            )
    if self.config.train.nan_policy == "halt" and len(self.diverged) == len(self.members):
      raise train_loop.NonFiniteLossError(
        f"every learning rate of the sweep turned non-finite (first steps: {self.diverged}); halting "
        f"without saving. Set --config.train.nan_policy=skip to skip such steps instead."
      )

  def _check_resumable(self):
    step = super()._check_resumable()
    if step is not None:
      saved_config = self.checkpointer.record(step).get("config") or {}
      train = saved_config.get("train", {})
      saved = train.get("lr_sweep")
      if saved is not None and tuple(float(x) for x in saved) != tuple(
        float(x) for x in self.config.train.lr_sweep
      ):
        raise schema.ConfigError(
          f"config.train.lr_sweep: {self.workdir} holds a sweep over {tuple(saved)} (step {step}); "
          f"resume it with those rates or start a new workdir for {self.lrs}"
        )
      saved_seeds = schema.parse_seeds(schema.setting(saved_config, "train.seeds"))
      if saved_seeds != self.seeds:
        raise schema.ConfigError(
          f"config.train.seeds: {self.workdir} holds a sweep over seeds {saved_seeds or '(none)'} (step "
          f"{step}); resume it with those seeds or start a new workdir for {self.seeds or '(none)'}"
        )
    return step

  # ---------------------------------------------------------------- reporting
  def _metric_writer(self, start_step: int):
    return _MemberWriters(
      self.member_dirs, self.config.logging.tensorboard, self.is_main, start_step
    )

  def _host_metrics(self, metrics) -> dict:
    return {k: np.asarray(jax.device_get(v), np.float64) for k, v in metrics.items()}

  def _progress_line(self, step, total, tokens_per_s, eta_s) -> str:
    m = self.last_metrics
    per = ", ".join(
      f"{k}: {loss:.4f}/{acc:.3f}" for k, loss, acc in zip(self.labels, m["loss"], m["accuracy"])
    )
    speed = (
      ""
      if tokens_per_s is None
      else f" | {tokens_per_s / 1e3:.1f}k tok/s | ETA {logging_utils.fmt_time(eta_s)}"
    )
    flops = self._throughput_text(tokens_per_s)
    return f"step {step}/{total} | loss/accuracy by lr: {per}{speed}{flops}"

  def _describe_eval(self, metrics, final=False) -> str:
    return ", ".join(
      f"lr {k}: loss {loss:.4f} {'val ' if final else ''}accuracy {acc:.4f}"
      for k, loss, acc in zip(self.labels, metrics["loss"], metrics["accuracy"])
    )

  def member_state(self, i: int):
    return jax.tree.map(lambda x: x[i], {k: v for k, v in self.state.items() if k != "alive"})

  def member_config(self, i: int) -> dict:
    """The config (JSON) of the single run member ``i`` trains as."""
    lr, seed = self.members[i]
    c = self.config_json
    cfg = dict(
      c, optim=dict(c["optim"], learning_rate=lr), train=dict(c["train"], lr_sweep=[], seeds="")
    )
    if self.seeded:
      cfg.update(seed=seed, data=dict(c["data"], shuffle_seed=seed))
    return cfg

  def _write_summary(self, summary: dict):
    """The sweep's summary, and each member's folder as a plain run's (config, summary, final checkpoint)."""
    members = []
    for i, ((lr, seed), d) in enumerate(zip(self.members, self.member_dirs)):
      one = {k: v for k, v in summary.items() if k not in ("train", "eval")}
      one["train"] = {k: float(v[i]) for k, v in (summary.get("train") or {}).items()}
      one["eval"] = {k: float(v[i]) for k, v in (summary.get("eval") or {}).items()}
      one["learning_rate"] = lr
      if self.seeded:
        one["seed"] = seed
      one["sweep"] = self.workdir
      if i in self.diverged:
        one["status"], one["diverged_at_step"] = "diverged", self.diverged[i]
      cfg = self.member_config(i)
      if one["status"] == "completed":
        self._save_member(i, d, cfg)  # every process: orbax saves are collective
      members.append(
        {
          "learning_rate": lr,
          **({"seed": seed} if self.seeded else {}),
          "dir": d,
          "status": one["status"],
          "eval": one["eval"],
        }
      )
      if not self.is_main:
        continue
      logging_utils.write_json(os.path.join(d, "config.json"), cfg)
      logging_utils.write_summary(d, one)
      if self.config.logging.plot:
        logging_utils.plot_loss(d)
    if self.is_main:
      summary = {k: v for k, v in summary.items() if k not in ("train", "eval")}
      logging_utils.write_summary(self.workdir, dict(summary, members=members))

  def _save_member(self, i: int, directory: str, cfg: dict):
    """The member's final state as a plain run's checkpoint (what evaluate and init_from read)."""
    if not self.config.checkpoint.enabled:
      return
    ck = ckpt_lib.Checkpointer(os.path.join(directory, "checkpoints"), 1, async_save=False)
    try:
      step = self.step()
      if ck.latest_step() != step:
        record = {
          "step": step,
          "initial_state": self.strategy,
          "init_from": self.config.train.init_from,
          "init_from_step": self.init_from_step,
          "config": cfg,
          "sweep": self.workdir,
        }
        ck.save(step, self.member_state(i), self.data_iter, record, force=True)
    finally:
      ck.close()

  def step(self) -> int:
    return int(self.state["step"][0])

  def maybe_restore(self) -> bool:
    restored = super().maybe_restore()
    if restored:  # members frozen before the stop stay reported (their first bad step is not kept)
      alive = np.asarray(jax.device_get(self.state["alive"]))
      self.diverged.update(
        {int(i): None for i in np.flatnonzero(~alive) if int(i) not in self.diverged}
      )
    return restored


def make_trainer(config, workdir: str, devices=None) -> trainer_lib.Trainer:
  """A SweepTrainer when ``config.train.lr_sweep`` lists rates or ``config.train.seeds`` seeds, else a
  Trainer."""
  if config.train.get("lr_sweep") or schema.parse_seeds(schema.setting(config, "train.seeds")):
    return SweepTrainer(config, workdir, devices)
  return trainer_lib.Trainer(config, workdir, devices)
