"""Flax NNX layers of kdn_jax (mixers, norms, short conv, MLP) and the mixer registry."""

from kdn_jax.layers.attention import Attention, FullAttention, SlidingWindowAttention, rope
from kdn_jax.layers.decay import Decay
from kdn_jax.layers.delta_mixers import GDN2, GLA, KDA, DeltaNet, GatedDeltaNet
from kdn_jax.layers.dense import LOGICAL_AXES, Dense, LowRank, make_param
from kdn_jax.layers.gated_norm import GatedRMSNorm, RMSNorm
from kdn_jax.layers.kdn_mixer import KDNDiag, KDNIso, KDNMixer
from kdn_jax.layers.mamba2 import Mamba2
from kdn_jax.layers.mamba2_official import Mamba2Official
from kdn_jax.layers.mlp import SwiGLU
from kdn_jax.layers.recurrent import RecurrentMixer
from kdn_jax.layers.registry import ATTENTION_MIXERS, MIXERS, is_recurrent, make_mixer
from kdn_jax.layers.sharding import logical_axis_rules
from kdn_jax.layers.short_conv import ShortConv, positions_in_segment
