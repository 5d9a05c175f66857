"""Language models of kdn_jax."""

from kdn_jax.models.config import (
  SIZES,
  layer_mixers,
  matched_mlp_hidden,
  mixer_param_count,
  model_config,
  validate_config,
)
from kdn_jax.models.generate import generate, sample_logits
from kdn_jax.models.lm import Block, LanguageModel
from kdn_jax.models.param_counts import param_count
