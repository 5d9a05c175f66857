"""Autoregressive generation: prefill the prompt with the chunked path, then decode token by token
from the cache (recurrent state / KV cache) inside one jitted lax.scan."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def sample_logits(logits, rng, temperature: float = 0.0, top_k: int | None = None):
    """logits [B, V] -> tokens [B] int32. temperature 0 = greedy."""
    if temperature is None or temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new_tokens', 'temperature', 'top_k'))
def _generate(graphdef, state, prompt, rng, *, max_new_tokens, temperature, top_k):
    model = nnx.merge(graphdef, state)
    B, Tp = prompt.shape
    cache = model.init_cache(B, Tp + max_new_tokens)
    logits, cache = model.prefill(prompt, cache)

    def body(carry, _):
        last, cache, rng = carry
        rng, sub = jax.random.split(rng)
        tok = sample_logits(last, sub, temperature, top_k)
        last, cache = model.decode_step(tok, cache)
        return (last, cache, rng), tok

    (_, _, _), toks = jax.lax.scan(body, (logits[:, -1], cache, rng), None, length=max_new_tokens)
    return toks.T


def generate(model, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None, rng=None):
    """prompt [B, T] int32 -> [B, T + max_new_tokens] (prompt followed by the generated tokens)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    if max_new_tokens <= 0:
        return prompt
    if rng is None:
        if temperature and temperature > 0:
            raise ValueError('sampling with temperature > 0 needs rng')
        rng = jax.random.key(0)
    graphdef, state = nnx.split(model)
    new = _generate(graphdef, state, prompt, rng, max_new_tokens=int(max_new_tokens),
                    temperature=float(temperature or 0.0), top_k=None if top_k is None else int(top_k))
    return jnp.concatenate([prompt, new], axis=1)
