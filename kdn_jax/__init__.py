"""kdn_jax: Kalman Delta Networks and length-generalising recurrent models in JAX."""

from kdn_jax import ops

__all__ = ["ops"]
__version__ = "0.1.0"
