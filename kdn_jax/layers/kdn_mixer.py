"""Kalman Delta Network mixers (MATH.md §2, §3, §6): diagonal (`kdn_diag`) and isotropic (`kdn_iso`).

Per token: L2-normalised q, k (after short conv + SiLU), v; KDA-style decay
log_alpha = -exp(A_log) * softplus(f(x) + dt_bias) (f low rank d -> rank -> H*K);
process noise omega = softplus(.) (diag: low rank d -> rank -> H*K, second layer zero-initialised;
iso: d -> H); observation noise r = r_min + softplus(d -> H).
Learned positive initial variance per head c0 = floor + softplus(raw) (init 1.0, floor 0.1).

Options (config keys):
  info_scale: "1" | "sqrt_k" | "k" | "4k" | "learned" | float   (learned: exp(log_mu) per head, init K)
  noise:      "learned" | "fixed_r" (r = 1) | "fixed" (r = 1 and omega = 1)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax import ops
from kdn_jax.ops import context_parallel
from kdn_jax.layers.decay import Decay
from kdn_jax.layers.dense import Dense, LowRank, constant_init, inv_softplus, make_param, zeros_init
from kdn_jax.layers.recurrent import RecurrentMixer

INFO_SCALES = ('1', 'sqrt_k', 'k', '4k', 'learned')
NOISE_MODES = ('learned', 'fixed_r', 'fixed')
VARIANCE_FLOOR = 0.1
VARIANCE_INIT = 1.0


def resolve_info_scale(info_scale, K: int):
    """Returns (python float | None for learned)."""
    if isinstance(info_scale, (int, float)) and not isinstance(info_scale, bool):
        if info_scale <= 0:
            raise ValueError(f'info_scale must be > 0, got {info_scale}')
        return float(info_scale)
    s = str(info_scale).lower()
    if s == 'learned':
        return None
    table = {'1': 1.0, 'sqrt_k': math.sqrt(K), 'k': float(K), '4k': 4.0 * K}
    if s in table:
        return table[s]
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f'info_scale: unknown value {info_scale!r}; expected one of {INFO_SCALES} or a positive float')
    if v <= 0:
        raise ValueError(f'info_scale must be > 0, got {info_scale}')
    return v


class KDNMixer(RecurrentMixer):
    has_variance = True
    diagonal = True

    def _init_gates(self, cfg, rngs):
        d, H, K = self.d_model, self.num_heads, self.key_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
        self.noise = str(cfg.noise)
        if self.noise not in NOISE_MODES:
            raise ValueError(f'noise: unknown value {cfg.noise!r}; expected one of {NOISE_MODES}')
        self.r_min = float(cfg.r_min)
        if self.r_min <= 0:
            raise ValueError(f'r_min must be > 0, got {cfg.r_min}')
        self.decay = Decay(d, H, K, per_channel=True, rank=self.rank, **kw)
        if self.noise == 'fixed':
            self.omega_proj = None
        elif self.diagonal:
            self.omega_proj = LowRank(d, self.rank, (H, K), ('heads', 'kv'), use_bias=True, zero_second=True, **kw)
        else:
            self.omega_proj = Dense(d, H, ('embed', 'heads'), use_bias=True, **kw)
        if self.noise == 'learned':
            self.r_proj = Dense(d, H, ('embed', 'heads'), use_bias=True, **kw)
        else:
            self.r_proj = None
        self.variance_raw = make_param(rngs, constant_init(inv_softplus(VARIANCE_INIT - VARIANCE_FLOOR)), (H,),
                                       self.param_dtype, ('heads',))
        mu = resolve_info_scale(cfg.info_scale, K)
        self.info_scale_fixed = mu
        if mu is None:
            self.log_info_scale = make_param(rngs, constant_init(math.log(K)), (H,), self.param_dtype, ('heads',))
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

    def noise_params(self, x):
        """x [..., d] -> (omega [..., H, K] (diag) / [..., H] (iso), r [..., H]), float32."""
        H, K = self.num_heads, self.key_dim
        lead = x.shape[:-1]
        om_shape = lead + ((H, K) if self.diagonal else (H,))
        if self.omega_proj is None:
            omega = jnp.ones(om_shape, jnp.float32)
        else:
            omega = jax.nn.softplus(self.omega_proj(x).astype(jnp.float32))
        if self.r_proj is None:
            r = jnp.ones(lead + (H,), jnp.float32)
        else:
            r = self.r_min + jax.nn.softplus(self.r_proj(x).astype(jnp.float32))
        return omega, r

    def _gates(self, x):
        omega, r = self.noise_params(x)
        return {'log_alpha': self.decay(x), 'omega': omega, 'r': r}

    def _init_core(self, batch):
        H, K = self.num_heads, self.key_dim
        c0 = self.initial_variance()
        var = jnp.broadcast_to(c0[None, :, None], (batch, H, K)) if self.diagonal else jnp.broadcast_to(c0[None], (batch, H))
        return {'memory': jnp.zeros((batch, H, K, self.value_dim), jnp.float32), 'variance': var}

    def _core(self, q, k, v, gates, state, segment_ids):
        fn = context_parallel.op('diag_kdn' if self.diagonal else 'iso_kdn')
        o, fs = fn(q, k, v, gates['log_alpha'], gates['omega'], gates['r'], info_scale=self.info_scale(),
                   initial_state=ops.KDNState(state['memory'], state['variance']), output_final_state=True,
                   segment_ids=segment_ids, impl=self.impl, chunk_size=self.chunk_size)
        return o, {'memory': fs.memory, 'variance': fs.variance}

    def write_strength(self, x, *, initial_state=None, segment_ids=None):
        """Effective same-key write strength beta_eff = z / (r + z), z = k^T P_hat k (MATH.md section 2; iso:
        z = b_hat ||k||^2), per token and head: the KDN paper's probe. x [B, T, d] -> float32 [B, T, H]."""
        B = x.shape[0]
        state = self.init_state(B) if initial_state is None else initial_state
        _, k, _, _ = self.project(x, state['conv'], segment_ids)
        g = self._gates(x)
        kf = k.astype(jnp.float32)
        scan = ops.diag_variance_scan if self.diagonal else ops.iso_variance_scan
        prior, _ = scan(kf, g['log_alpha'], g['omega'], g['r'], self.info_scale(), state['variance'], segment_ids)
        z = jnp.sum(prior * kf * kf, axis=-1) if self.diagonal else prior * jnp.sum(kf * kf, axis=-1)
        return z / (g['r'] + z)

    def _core_step(self, q, k, v, gates, state):
        fn = ops.diag_kdn_step if self.diagonal else ops.iso_kdn_step
        o, fs = fn(q, k, v, gates['log_alpha'], gates['omega'], gates['r'],
                   ops.KDNState(state['memory'], state['variance']), info_scale=self.info_scale())
        return o, {'memory': fs.memory, 'variance': fs.variance}


class KDNDiag(KDNMixer):
    diagonal = True


class KDNIso(KDNMixer):
    diagonal = False
