"""The training loss: token cross-entropy (with an optional z-loss) and accuracy, read everywhere or
only at each row's scored positions (``train.loss_positions``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cross_entropy(logits, targets, mask, z_loss=0.0):
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = lse - tgt
  if z_loss:
    nll = nll + z_loss * lse**2
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(correct * mask), jnp.sum(mask)


def supervised_positions(mask, count: int):
  """[B, count] positions of the first ``count`` scored entries of each row of ``mask`` [B, T], in order
  (rows with fewer are padded with unscored positions)."""
  return jnp.argsort(mask <= 0, axis=1, stable=True)[:, :count].astype(jnp.int32)


def scored_logits(model, batch, count: int, **kwargs):
  """(logits, final states, targets, mask, dropped): everywhere, or with ``count`` > 0 at the first ``count``
  scored positions of each row only (train.loss_positions); ``dropped`` = the scored entries left out."""
  pos = supervised_positions(batch["mask"], count) if count else None
  logits, final = model(
    batch["inputs"], segment_ids=batch.get("segment_ids"), read_positions=pos, **kwargs
  )
  if pos is None:
    return logits, final, batch["targets"], batch["mask"], jnp.zeros((), jnp.float32)
  mask = jnp.take_along_axis(batch["mask"], pos, axis=1)
  return (
    logits,
    final,
    jnp.take_along_axis(batch["targets"], pos, axis=1),
    mask,
    jnp.sum(batch["mask"]) - jnp.sum(mask),
  )


def check_dropped(config, dropped, where: str):
  """Raises when train.loss_positions left scored entries out (a row had more than it allows)."""
  if np.any(np.asarray(dropped) > 0):
    raise ValueError(
      f"config.train.loss_positions={config.train.loss_positions}: {where} has rows with more "
      f"scored positions ({int(np.max(dropped))} entries left out); raise it, or 0 = every position"
    )
