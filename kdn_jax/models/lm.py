"""Language model: token embedding -> pre-norm blocks (mixer + SwiGLU) -> RMSNorm -> tied/untied head.
mamba_ssm's Mamba-2 LM (config.official_mamba2_lm): blocks without the SwiGLU, norms eps 1e-5, the
embedding N(0, 0.02) and its tied read-out unscaled.

``LanguageModel(cfg, *, rngs)``
  __call__(tokens [B,T] int32, *, states=None, segment_ids=None) -> (logits f32 [B,T,vocab], new_states)
      states: list with one entry per layer (recurrent: state dict, attention: None); None = normal start.
  init_states(batch)           default ("normal start") states; KDN variance = learned c0 per head.
  init_cache(batch, max_len)   decode caches (recurrent: state dict, attention: KV cache).
  prefill(tokens, cache)       -> (logits, cache)      chunked path, continues from the cache.
  prefix_states(tokens, positions) -> (logits [B,P,vocab], caches): the decode cache after each prefix
                               tokens[:, :p], from one forward (recurrent mixers).
  decode_step(token [B], cache) -> (logits [B,vocab], cache)
  mixer_inputs(tokens)         every mixer's normalised input (probes).
The residual stream is kept in float32; mixers/MLP compute in cfg.dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
from flax import nnx

from kdn_jax.layers.dense import Dense, make_param, normal_init, project
from kdn_jax.layers.gated_norm import RMSNorm
from kdn_jax.layers.mamba2_official import NORM_EPS as OFFICIAL_NORM_EPS
from kdn_jax.layers.mlp import SwiGLU
from kdn_jax.layers.options import option
from kdn_jax.layers.recurrent import get_dtype
from kdn_jax.layers.registry import is_recurrent, make_mixer
from kdn_jax.models import layer_scan
from kdn_jax.models.config import (
  effective_mlp_hidden,
  layer_mixers,
  official_mamba2_lm,
  validate_config,
)
from kdn_jax.ops import states_at as ops_states_at

OFFICIAL_EMBED_STD = 0.02  # mamba_ssm's initializer_range (its embedding's only init)


def norm_eps(cfg) -> float:
  """The block and final norms' eps: mamba_ssm's norm_epsilon for its Mamba-2 LM, else norm_eps."""
  return OFFICIAL_NORM_EPS if official_mamba2_lm(cfg) else float(cfg.norm_eps)


class Block(nnx.Module):
  def __init__(self, cfg, mixer_name: str, *, rngs: nnx.Rngs, kernel_config=None):
    d = int(cfg.d_model)
    dtype, pdt = get_dtype(cfg.dtype), get_dtype(cfg.param_dtype)
    eps = norm_eps(cfg)
    self.mixer_name = mixer_name
    self.norm1 = RMSNorm(d, eps=eps, dtype=dtype, param_dtype=pdt)
    self.mixer = make_mixer(mixer_name, cfg, rngs=rngs, kernel_config=kernel_config)
    hidden = effective_mlp_hidden(cfg)
    if hidden:
      self.norm2 = RMSNorm(d, eps=eps, dtype=dtype, param_dtype=pdt)
      self.mlp = SwiGLU(d, hidden, dtype=dtype, param_dtype=pdt, rngs=rngs)
    else:  # mamba_ssm's LM with d_intermediate = 0: the mixer is the block
      self.norm2 = self.mlp = None

  def _mlp(self, x):
    """x plus the MLP branch (x itself in a block without an MLP)."""
    if self.mlp is None:
      return x
    return x + self.mlp(self.norm2(x)).astype(jnp.float32)

  def __call__(self, x, state=None, segment_ids=None):
    y, st = self.mixer(self.norm1(x), initial_state=state, segment_ids=segment_ids)
    return self._mlp(x + y.astype(jnp.float32)), st

  def with_states_at(self, x, positions, state=None, segment_ids=None):
    """Like __call__, plus the mixer's state after each position (leaves [B, P, ...])."""
    if not is_recurrent(self.mixer_name):
      raise NotImplementedError(
        f"prefix states: mixer {self.mixer_name!r} keeps no recurrent state to "
        "read at positions (attention layers are not supported)"
      )
    y, st, at = self.mixer(
      self.norm1(x), initial_state=state, segment_ids=segment_ids, states_at=positions
    )
    return self._mlp(x + y.astype(jnp.float32)), st, at

  def prefill(self, x, cache):
    y, cache = self.mixer.prefill(self.norm1(x), cache)
    return self._mlp(x + y.astype(jnp.float32)), cache

  def step(self, x_t, cache):
    y, cache = self.mixer.step(self.norm1(x_t), cache)
    return self._mlp(x_t + y.astype(jnp.float32)), cache


class LanguageModel(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs, kernel_config=None):
    """kernel_config: the Pallas kernels' configs for every layer (a pallas_kernels.KernelConfigs,
    a run's config.kernels through experiments/kernel_config.py), or None: the kernels'
    tuned configs for the device."""
    validate_config(cfg)
    self.cfg = ml_collections.FrozenConfigDict(
      cfg
    )  # hashable, so the graphdef can be a static jit arg
    d, vocab = int(cfg.d_model), int(cfg.vocab_size)
    self.dtype, pdt = get_dtype(cfg.dtype), get_dtype(cfg.param_dtype)
    self.layer_names = tuple(layer_mixers(cfg))
    # mamba_ssm's LM: embedding N(0, 0.02), its tied read-out unscaled; else N(0, 1), the tied
    # read-out scaled by d^-1/2 (_logits)
    official = official_mamba2_lm(cfg)
    std = OFFICIAL_EMBED_STD if official else 1.0
    self.readout_scale = 1.0 if official else d**-0.5
    self.embed = make_param(rngs, normal_init(std), (vocab, d), pdt, ("vocab", "embed"))
    self.blocks = nnx.List(
      [Block(cfg, name, rngs=rngs, kernel_config=kernel_config) for name in self.layer_names]
    )
    self.final_norm = RMSNorm(d, eps=norm_eps(cfg), dtype=self.dtype, param_dtype=pdt)
    self.tie_embeddings = bool(cfg.tie_embeddings)
    if self.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Dense(
        d, vocab, ("embed", "vocab"), dtype=self.dtype, param_dtype=pdt, rngs=rngs
      )
    self.remat = bool(option(cfg, "remat"))
    self.scan_layers = bool(option(cfg, "scan_layers"))

  # ---------------------------------------------------------------------------------------------
  def _embed(self, tokens):
    return jnp.take(self.embed[...], tokens, axis=0).astype(jnp.float32)

  def _logits(self, x):
    h = self.final_norm(x)
    if self.tie_embeddings:
      # N(0, 1) embeddings read out scaled by d^-1/2 give O(1) initial logits
      w = self.embed[...].astype(self.dtype)
      logits = project(h.astype(self.dtype), w, (((h.ndim - 1,), (1,))))
      return logits if self.readout_scale == 1.0 else logits * self.readout_scale
    return self.lm_head(h).astype(jnp.float32)

  def init_states(self, batch: int) -> list:
    return [blk.mixer.init_state(batch) for blk in self.blocks]

  def init_cache(self, batch: int, max_len: int) -> list:
    return [blk.mixer.init_cache(batch, max_len) for blk in self.blocks]

  def __call__(self, tokens, *, states=None, segment_ids=None, read_positions=None):
    """tokens [B, T] -> (logits [B, T, V] float32, final states). ``read_positions`` [B, P] int: logits
    only at those positions ([B, P, V]): a loss scored at a few positions (MQAR's queries) need not
    hold the vocabulary's logits at every position."""
    if states is None:
      states = [None] * len(self.blocks)
    if len(states) != len(self.blocks):
      raise ValueError(f"states has {len(states)} entries, model has {len(self.blocks)} layers")
    x = self._embed(tokens)
    if self.scan_layers and layer_scan.can_scan(self.layer_names, states):
      x, new_states = layer_scan.scan_blocks(
        list(self.blocks), self.layer_names, x, states, segment_ids, remat=self.remat
      )
      return self._logits(_take_positions(x, read_positions)), new_states
    new_states = []
    for blk, st in zip(self.blocks, states):
      if self.remat:
        x, st = nnx.remat(lambda b, x_, s_, seg_: b(x_, s_, seg_))(blk, x, st, segment_ids)
      else:
        x, st = blk(x, st, segment_ids)
      new_states.append(st)
    return self._logits(_take_positions(x, read_positions)), new_states

  def has_prefix_states(self) -> bool:
    """Whether prefix_states applies: every layer a recurrent mixer."""
    return all(is_recurrent(name) for name in self.layer_names)

  def prefix_states(self, tokens, positions, *, states=None, segment_ids=None):
    """The decode cache after each prompt prefix, from one forward (the ops' output_states_at).

    tokens [B, T] int32; positions: [P] ints known when tracing, sorted, in [1, T] (prefix p =
    tokens[:, :p]). Returns (logits [B, P, vocab] float32: the next-token logits after each
    prefix, caches: one entry per layer, the state that layer's decode_step continues from
    after each prefix, leaves [B, P, ...]; `kdn_jax.models.generate.cache_at` picks one).
    Recurrent mixers only."""
    positions = ops_states_at.check_positions("prefix_states", positions, tokens.shape[1])
    if states is None:
      states = [None] * len(self.blocks)
    x = self._embed(tokens)
    caches = []
    for blk, st in zip(self.blocks, states):
      x, _, at = blk.with_states_at(x, positions, st, segment_ids)
      caches.append(at)
    read = jnp.broadcast_to(jnp.asarray(positions - 1)[None], (tokens.shape[0], len(positions)))
    return self._logits(_take_positions(x, read)), caches

  def mixer_inputs(self, tokens, *, segment_ids=None) -> list:
    """The normalised input of every layer's mixer ([B, T, d] each), from the normal initial state:
    for probes of the recurrence (e.g. KDN's write strength) on real activations."""
    x = self._embed(tokens)
    out = []
    for blk in self.blocks:
      out.append(blk.norm1(x))
      x, _ = blk(x, None, segment_ids)
    return out

  def prefill(self, tokens, cache):
    x = self._embed(tokens)
    new = []
    for blk, c in zip(self.blocks, cache):
      x, c = blk.prefill(x, c)
      new.append(c)
    return self._logits(x), new

  def decode_step(self, token, cache):
    x = self._embed(token)
    new = []
    for blk, c in zip(self.blocks, cache):
      x, c = blk.step(x, c)
      new.append(c)
    return self._logits(x), new


def _take_positions(x, positions):
  """x [B, T, d] at positions [B, P] -> [B, P, d] (None: x)."""
  if positions is None:
    return x
  return jnp.take_along_axis(x, positions[..., None].astype(jnp.int32), axis=1)
