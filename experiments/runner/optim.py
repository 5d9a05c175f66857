"""AdamW with linear warmup + cosine decay, global-norm clipping and a path-based weight-decay mask."""

from __future__ import annotations

import jax
import optax


def schedule(config, peak_lr: float | None = None) -> optax.Schedule:
  """Warm-up then cosine to ``min_lr_ratio`` x the peak: ``peak_lr``, or ``optim.learning_rate`` when None.
  Every value is proportional to the peak (a learning-rate sweep trains at peak 1 and scales the update)."""
  o = config.optim
  peak = o.learning_rate if peak_lr is None else peak_lr
  total = max(int(config.train.num_steps), 1)
  warmup = min(int(o.warmup_steps), total)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup else peak,
    peak_value=peak,
    warmup_steps=warmup,
    decay_steps=max(total, warmup + 1),
    end_value=peak * o.min_lr_ratio,
  )


def path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def decay_mask(params, patterns: str):
  """True where weight decay applies: parameters whose path contains none of ``patterns``."""
  pats = [p.strip() for p in patterns.split(",") if p.strip()]
  return jax.tree_util.tree_map_with_path(
    lambda path, _: not any(p in path_str(path) for p in pats), params
  )


def make_optimizer(config, params, peak_lr: float | None = None) -> optax.GradientTransformation:
  """AdamW: the decoupled weight decay is added before the rate scales the update, so the update is
  proportional to the peak rate (``peak_lr``; None: ``optim.learning_rate``)."""
  o = config.optim
  parts = []
  if o.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(o.clip_norm))
  parts.append(
    optax.adamw(
      schedule(config, peak_lr),
      b1=o.b1,
      b2=o.b2,
      eps=o.eps,
      weight_decay=o.weight_decay,
      mask=decay_mask(params, o.no_decay),
    )
  )
  return optax.chain(*parts)
