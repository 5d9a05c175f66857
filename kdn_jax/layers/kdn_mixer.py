"""Kalman Delta Network mixers (docs/math.md §2, §3, §6): diagonal (`kdn_diag`) and isotropic (`kdn_iso`).

Per token: L2-normalised q, k (after short conv + SiLU), v; KDA-style decay
log_alpha = -exp(A_log) * softplus(f(x) + dt_bias) (f low rank d -> rank -> H*K);
process noise omega = softplus(.) (diag: low rank d -> rank -> H*K, second layer zero-initialised;
iso: d -> H); observation noise r = r_min + softplus(d -> H).
Learned positive initial variance per head c0 = floor + softplus(raw) (init 1.0, floor 0.1).

With impl 'pallas' (also 'auto' on a GPU) and learned noise, the gate front-end (the softplus /
exp activations above) runs inside the gain kernels (pallas_kernels.kdn_gain.*_gain_fused): the
layer hands them the projections, and they emit the delta rule's log_alpha. The plain-JAX
front-end (`gate_values`) stays the reference and serves the other impls, decoding and the
beta_eff probe; `fuse_front = False` on an instance turns the fused path off. Likewise the q/k/v
short convs and the gated output norm run as Pallas kernels on that path (`fuse_conv`, `fuse_norm`;
RecurrentMixer).

Options (config keys):
  info_scale: "1" | "sqrt_k" | "k" | "4k" | "learned" | float   (learned: exp(log_mu) per head, init K)
  noise:      "learned" | "fixed_r" (r = 1) | "fixed" (r = 1 and omega = 1)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kdn_jax import ops
from kdn_jax.layers.decay import Decay, decay_ranges
from kdn_jax.layers.dense import Dense, LowRank, constant_init, inv_softplus, make_param
from kdn_jax.layers.recurrent import RecurrentMixer, states_kw
from kdn_jax.ops import context_sharding, dispatch

INFO_SCALES = ("1", "sqrt_k", "k", "4k", "learned")
NOISE_MODES = ("learned", "fixed_r", "fixed")
VARIANCE_FLOOR = 0.1
VARIANCE_INIT = 1.0


def info_scale_text(value) -> str:
  """``info_scale`` as a config keeps it (a str: ConfigDict is type safe): a name of INFO_SCALES
  (lower case) or a number as ``repr(float)``; other text is returned as given, stripped and lower
  case, for resolve_info_scale to reject."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return repr(float(value))
  text = str(value).strip().lower()
  if text in INFO_SCALES:
    return text
  try:
    return repr(float(text))
  except ValueError:
    return text


def resolve_info_scale(info_scale, K: int):
  """The one reading of the ``info_scale`` option (a name of INFO_SCALES or a positive number, as
  text or number) for key dim K: a python float, or None for learned. Raises ValueError."""
  text = info_scale_text(info_scale)
  if text == "learned":
    return None
  table = {"1": 1.0, "sqrt_k": math.sqrt(K), "k": float(K), "4k": 4.0 * K}
  if text in table:
    return table[text]
  try:
    v = float(text)
  except ValueError:
    raise ValueError(
      f"info_scale: unknown value {info_scale!r}; expected one of {INFO_SCALES} or a positive float"
    ) from None
  if not (v > 0 and math.isfinite(v)):
    raise ValueError(f"info_scale must be > 0 and finite, got {info_scale}")
  return v


class KDNMixer(RecurrentMixer):
  has_variance = True
  diagonal = True
  fuse_front = True  # the gate front-end inside the gain kernels when the impl is pallas
  fuse_conv = True  # q/k/v short convs as Pallas kernels when the impl is pallas
  fuse_norm = True  # the gated output RMSNorm as a Pallas kernel, likewise

  def _init_gates(self, cfg, rngs):
    d, H, K = self.d_model, self.num_heads, self.key_dim
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
    self.noise = str(cfg.noise)
    if self.noise not in NOISE_MODES:
      raise ValueError(f"noise: unknown value {cfg.noise!r}; expected one of {NOISE_MODES}")
    self.r_min = float(cfg.r_min)
    if self.r_min <= 0:
      raise ValueError(f"r_min must be > 0, got {cfg.r_min}")
    self.decay = Decay(d, H, K, per_channel=True, rank=self.rank, **kw, **decay_ranges(cfg))
    if self.noise == "fixed":
      self.omega_proj = None
    elif self.diagonal:
      self.omega_proj = LowRank(
        d, self.rank, (H, K), ("heads", "kv"), use_bias=True, zero_second=True, **kw
      )
    else:
      self.omega_proj = Dense(d, H, ("embed", "heads"), use_bias=True, **kw)
    if self.noise == "learned":
      self.r_proj = Dense(d, H, ("embed", "heads"), use_bias=True, **kw)
    else:
      self.r_proj = None
    self.variance_raw = make_param(
      rngs,
      constant_init(inv_softplus(VARIANCE_INIT - VARIANCE_FLOOR)),
      (H,),
      self.param_dtype,
      ("heads",),
    )
    mu = resolve_info_scale(cfg.info_scale, K)
    self.info_scale_fixed = mu
    if mu is None:
      self.log_info_scale = make_param(
        rngs, constant_init(math.log(K)), (H,), self.param_dtype, ("heads",)
      )
    else:
      self.log_info_scale = None

  # -- parameters as used by the recurrence ----------------------------------------------------
  def initial_variance(self) -> jax.Array:
    """[H] learned positive initial variance c0 (floor 0.1)."""
    return VARIANCE_FLOOR + jax.nn.softplus(self.variance_raw[...].astype(jnp.float32))

  def info_scale(self):
    """python float or [H] float32 array (learned)."""
    if self.log_info_scale is None:
      return self.info_scale_fixed
    return jnp.exp(self.log_info_scale[...].astype(jnp.float32))

  def gate_projections(self, x):
    """x [..., d] -> the gate projections before their activations, in the compute dtype:
    f (decay), omega_raw, r_raw (None where the noise mode fixes them)."""
    return {
      "f": self.decay.f(x),
      "omega_raw": None if self.omega_proj is None else self.omega_proj(x),
      "r_raw": None if self.r_proj is None else self.r_proj(x),
    }

  def gate_values(self, raw, lead):
    """The plain-JAX gate front-end: projections -> (log_alpha, omega, r), float32; `lead` is
    the token dims ([B, T] or [B]) for the fixed noise modes' constants."""
    H, K = self.num_heads, self.key_dim
    om_shape = lead + ((H, K) if self.diagonal else (H,))
    if raw["omega_raw"] is None:
      omega = jnp.ones(om_shape, jnp.float32)
    else:
      omega = jax.nn.softplus(raw["omega_raw"].astype(jnp.float32))
    if raw["r_raw"] is None:
      r = jnp.ones(lead + (H,), jnp.float32)
    else:
      r = self.r_min + jax.nn.softplus(raw["r_raw"].astype(jnp.float32))
    return {"log_alpha": self.decay.activate(raw["f"])[0], "omega": omega, "r": r}

  def noise_params(self, x):
    """x [..., d] -> (omega [..., H, K] (diag) / [..., H] (iso), r [..., H]), float32."""
    g = self.gate_values(self.gate_projections(x), x.shape[:-1])
    return g["omega"], g["r"]

  def _gates(self, x):
    raw = self.gate_projections(x)
    # The activated gates are dead code (removed under jit) when the fused path takes 'raw'.
    return dict(self.gate_values(raw, x.shape[:-1]), raw=raw)

  def _fused_front(self, gates):
    """Whether _core runs the gate front-end inside the gain kernels: the pallas impl, learned
    noise (both projections present) and no float64 (the kernels compute in fp32)."""
    raw = gates["raw"]
    return (
      self.fuse_front
      and self.noise == "learned"
      and self._glue_kernels()
      and all(jnp.dtype(v.dtype).itemsize <= 4 for v in raw.values())
    )

  def _init_core(self, batch):
    H, K = self.num_heads, self.key_dim
    c0 = self.initial_variance()
    var = (
      jnp.broadcast_to(c0[None, :, None], (batch, H, K))
      if self.diagonal
      else jnp.broadcast_to(c0[None], (batch, H))
    )
    return {"memory": jnp.zeros((batch, H, K, self.value_dim), jnp.float32), "variance": var}

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    if self._fused_front(gates):
      return self._core_fused(q, k, v, gates, state, segment_ids, positions)
    fn = context_sharding.op("diag_kdn" if self.diagonal else "iso_kdn")
    o, fs, *at = fn(
      q,
      k,
      v,
      gates["log_alpha"],
      gates["omega"],
      gates["r"],
      info_scale=self.info_scale(),
      initial_state=ops.KDNState(state["memory"], state["variance"]),
      output_final_state=True,
      segment_ids=segment_ids,
      impl=self.impl,
      chunk_size=self.chunk_size,
      kernel_config=self.kernel_config,
      **states_kw(positions),
    )
    return (o, {"memory": fs.memory, "variance": fs.variance}) + tuple(
      {"memory": a.memory, "variance": a.variance} for a in at
    )

  def _core_fused(self, q, k, v, gates, state, segment_ids, positions=None):
    """The pallas path with the fused front-end: gain kernels on the projections (they emit
    log_alpha), then the delta rule with write kappa (iso: beta k), erase k. With positions,
    the variance after each comes from the XLA variance scan on the plain front-end's gates
    (the gain kernels keep their chunk carries inside)."""
    raw = gates["raw"]
    from pallas_kernels import kdn_gain  # pylint: disable=g-import-not-at-top

    fn = kdn_gain.diag_gain_fused if self.diagonal else kdn_gain.iso_gain_fused
    # (diag: kappa stored as the delta rule wants it for this data: write_dtype)
    write_dtype = dispatch.pallas_module().write_dtype(jnp.result_type(q, k, v))
    kw = dict(gain_dtype=write_dtype) if self.diagonal else {}
    decay = self.decay
    gain, log_alpha, variance = fn(
      k,
      raw["f"],
      decay.dt_bias[...],
      decay.A_log[...],
      raw["omega_raw"],
      raw["r_raw"],
      self.r_min,
      self.info_scale(),
      state["variance"],
      segment_ids,
      config=dispatch.family_config(self.kernel_config, "gain"),
      **kw,
    )
    # (iso: the write is beta k; the kernels form it from beta [B, T, H])
    o, memory, *mem_at = ops.delta_rule(
      q,
      k,
      v,
      log_alpha,
      gain,
      initial_state=state["memory"],
      output_final_state=True,
      segment_ids=segment_ids,
      impl="pallas",
      chunk_size=self.chunk_size,
      kernel_config=self.kernel_config,
      **states_kw(positions),
    )
    out = (o, {"memory": memory, "variance": variance})
    if positions is None:
      return out
    scan = ops.diag_variance_scan if self.diagonal else ops.iso_variance_scan
    _, post = scan(
      k.astype(jnp.float32),
      gates["log_alpha"],
      gates["omega"],
      gates["r"],
      self.info_scale(),
      state["variance"],
      segment_ids,
    )
    var_at = jnp.take(post, jnp.asarray(positions) - 1, axis=1)
    return out + ({"memory": mem_at[0], "variance": var_at},)

  def write_strength(self, x, *, initial_state=None, segment_ids=None):
    """Effective same-key write strength beta_eff = z / (r + z), z = k^T P_hat k (docs/math.md section 2; iso:
    z = b_hat ||k||^2), per token and head: the KDN paper's probe. x [B, T, d] -> float32 [B, T, H]."""
    B = x.shape[0]
    state = self.init_state(B) if initial_state is None else initial_state
    _, k, _, _ = self.project(x, state["conv"], segment_ids)
    g = self._gates(x)
    kf = k.astype(jnp.float32)
    scan = ops.diag_variance_scan if self.diagonal else ops.iso_variance_scan
    prior, _ = scan(
      kf, g["log_alpha"], g["omega"], g["r"], self.info_scale(), state["variance"], segment_ids
    )
    z = jnp.sum(prior * kf * kf, axis=-1) if self.diagonal else prior * jnp.sum(kf * kf, axis=-1)
    return z / (g["r"] + z)

  def _core_step(self, q, k, v, gates, state):
    fn = ops.diag_kdn_step if self.diagonal else ops.iso_kdn_step
    o, fs = fn(
      q,
      k,
      v,
      gates["log_alpha"],
      gates["omega"],
      gates["r"],
      ops.KDNState(state["memory"], state["variance"]),
      info_scale=self.info_scale(),
      impl=self._step_impl(),
      kernel_config=self.kernel_config,
    )
    return o, {"memory": fs.memory, "variance": fs.variance}


class KDNDiag(KDNMixer):
  diagonal = True


class KDNIso(KDNMixer):
  diagonal = False
