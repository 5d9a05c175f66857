"""Autoregressive generation: prefill the prompt with the chunked path (or start from a cached prefix
state), then decode token by token from the cache (recurrent state / KV cache, updated in place)
inside one jitted loop of fixed trip count that checks every EOS_CHECK_EVERY tokens whether every
row has emitted EOS (no host round trip per token).

``generate(model, prompt, n)`` -> prompt + n tokens. A cached prefix: ``logits, caches =
model.prefix_states(tokens, positions)`` holds the decode cache after every prefix
``tokens[:, :p]`` from one forward; ``generate(model, rest, n, cache=cache_at(caches, i))`` continues
after prefix i with the prompt's remaining tokens ``rest`` (or, with ``rest`` empty, from
``last_logits=logits[:, i]``), and equals generating from the whole prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import time

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


def cache_at(caches, i: int):
  """The decode cache after prefix i of ``model.prefix_states``' caches (leaves [B, P, ...] ->
  [B, ...])."""
  return jax.tree.map(lambda a: a[:, i], caches)


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Wall times of one ``generate`` call (compilation included on a first call of a shape).

  generated: tokens generated per row up to and including its EOS ([B] ints);
  time_to_first_token_s: prefill (or the cached prefix's logits) to the first sampled token;
  decode_s: the token loop after it; tokens_per_s: all rows' generated tokens over both;
  decode_tokens_per_s: the tokens after the first over decode_s."""

  generated: tuple
  time_to_first_token_s: float
  decode_s: float
  tokens_per_s: float
  decode_tokens_per_s: float


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "max_len"))
def _first_token(graphdef, state, prompt, cache, last_logits, rng, *, temperature, top_k, max_len):
  """Prefill (from cache, or a fresh one when None) and sample the first token."""
  model = nnx.merge(graphdef, state)
  if cache is None:
    cache = model.init_cache(prompt.shape[0], max_len)
  if prompt.shape[1]:
    logits, cache = model.prefill(prompt, cache)
    last_logits = logits[:, -1]
  rng, sub = jax.random.split(rng)
  return sample_logits(last_logits, sub, temperature, top_k), cache, rng


# Tokens between the checks whether every row has emitted EOS. A loop whose end depends on data
# reads its condition back to the host every iteration (a device-to-host sync per token); in
# blocks of this many steps with a fixed trip count the check is one sync per block, and at most
# this many - 1 steps run after the last row has stopped (they emit pad_id).
EOS_CHECK_EVERY = 16


def _decode_loop(
  graphdef,
  state,
  first,
  cache,
  rng,
  *,
  max_new_tokens,
  temperature,
  top_k,
  eos_id,
  pad_id,
  eos_check_every,
):
  """Tokens 1..max_new_tokens-1 after `first`; rows that emitted eos_id get pad_id after it.
  Without eos_id one loop of fixed trip count (no host sync); with it, blocks of eos_check_every
  fixed-trip steps until every row is done. Returns (tokens [B, max_new_tokens], generated count
  per row, the cache after the last step: returned so that a donated cache's buffers carry the
  loop's state in place)."""
  model = nnx.merge(graphdef, state)
  B = first.shape[0]
  out = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.zeros((B,), bool) if eos_id is None else first == eos_id
  count = jnp.ones((B,), jnp.int32)

  def token(i, carry):
    tok, cache, rng, out, done, count = carry
    logits, cache = model.decode_step(tok, cache)
    sub = None
    if temperature > 0:  # (greedy reads no key: no split kernel per token)
      rng, sub = jax.random.split(rng)
    tok = jnp.where(done, pad_id, sample_logits(logits, sub, temperature, top_k))
    out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
    count = count + (~done).astype(jnp.int32)
    if eos_id is not None:
      done = done | (tok == eos_id)
    return tok, cache, rng, out, done, count

  carry = (first, cache, rng, out, done, count)
  if eos_id is None:
    carry = jax.lax.fori_loop(1, max_new_tokens, token, carry)
    return carry[3], carry[5], carry[1]
  blocks, tail = divmod(max_new_tokens - 1, eos_check_every)

  def steps(start, n, carry):
    return jax.lax.fori_loop(0, n, lambda u, c: token(start + u, c), carry)

  def block(jc):
    j, carry = jc
    return j + 1, steps(1 + j * eos_check_every, eos_check_every, carry)

  not_all_done = lambda carry: ~jnp.all(carry[4])
  _, carry = jax.lax.while_loop(
    lambda jc: (jc[0] < blocks) & not_all_done(jc[1]), block, (jnp.int32(0), carry)
  )
  if tail:
    carry = jax.lax.cond(
      not_all_done(carry),
      lambda c: steps(1 + blocks * eos_check_every, tail, c),
      lambda c: c,
      carry,
    )
  return carry[3], carry[5], carry[1]


_STATIC = ("graphdef", "max_new_tokens", "temperature", "top_k", "eos_id", "pad_id")
_STATIC += ("eos_check_every",)
# The loop updates the cache in place; its input buffers are donated when generate made the cache
# (none was given), and copied once into the loop when they hold the caller's.
_decode_owned_cache = jax.jit(_decode_loop, static_argnames=_STATIC, donate_argnames=("cache",))
_decode_callers_cache = jax.jit(_decode_loop, static_argnames=_STATIC)


def generate(
  model,
  prompt,
  max_new_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int | None = None,
  rng=None,
  cache=None,
  last_logits=None,
  eos_id: int | None = None,
  pad_id: int | None = None,
  return_stats: bool = False,
  eos_check_every: int = EOS_CHECK_EVERY,
):
  """prompt [B, T] int32 -> [B, T + max_new_tokens] (prompt followed by the generated tokens).

  cache: a decode cache to continue from (``model.init_cache`` layout, e.g. ``cache_at`` of
  ``model.prefix_states``); the prompt then holds the tokens after that prefix, and may be empty
  ([B, 0]) when ``last_logits`` [B, vocab] (the logits after the prefix) is given. eos_id: a row
  stops after emitting it; its later positions hold pad_id (default eos_id), and the loop ends when
  every row has stopped (checked every eos_check_every tokens: EOS_CHECK_EVERY says why).
  return_stats: also return GenerationStats (tokens/s, time to first token). The caller's cache
  is read, never consumed."""
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2:
    raise ValueError(f"generate: prompt must be [B, T] token ids, got shape {prompt.shape}")
  if prompt.shape[1] == 0 and (cache is None or last_logits is None):
    raise ValueError("generate: an empty prompt needs a cache and last_logits (the cached prefix)")
  if last_logits is not None and prompt.shape[1]:
    raise ValueError(
      "generate: last_logits is for an empty prompt (the prompt prefills from cache)"
    )
  if int(eos_check_every) < 1:
    raise ValueError(f"generate: eos_check_every must be >= 1, got {eos_check_every}")
  if max_new_tokens <= 0:
    return (prompt, None) if return_stats else prompt
  if rng is None:
    if temperature and temperature > 0:
      raise ValueError("sampling with temperature > 0 needs rng")
    rng = jax.random.key(0)
  pad_id = eos_id if pad_id is None else pad_id
  pad_id = 0 if pad_id is None else int(pad_id)
  graphdef, state = nnx.split(model)
  sampling = dict(
    temperature=float(temperature or 0.0), top_k=None if top_k is None else int(top_k)
  )
  # only a cache generate makes is donated: a leaf of the caller's that the prefill leaves as it
  # is would come back from _first_token as the caller's own buffer
  owned = cache is None
  t0 = time.perf_counter()
  first, cache, rng = _first_token(
    graphdef,
    state,
    prompt,
    cache,
    last_logits,
    rng,
    max_len=int(prompt.shape[1] + max_new_tokens),
    **sampling,
  )
  first.block_until_ready()
  t1 = time.perf_counter()
  new, count, _ = (_decode_owned_cache if owned else _decode_callers_cache)(
    graphdef,
    state,
    first,
    cache,
    rng,
    max_new_tokens=int(max_new_tokens),
    eos_id=None if eos_id is None else int(eos_id),
    pad_id=pad_id,
    eos_check_every=int(eos_check_every),
    **sampling,
  )
  new.block_until_ready()
  t2 = time.perf_counter()
  out = jnp.concatenate([prompt, new], axis=1)
  if not return_stats:
    return out
  total = int(jnp.sum(count))
  stats = GenerationStats(
    generated=tuple(int(c) for c in count),
    time_to_first_token_s=t1 - t0,
    decode_s=t2 - t1,
    tokens_per_s=total / max(t2 - t0, 1e-12),
    decode_tokens_per_s=(total - prompt.shape[0]) / max(t2 - t1, 1e-12),
  )
  return out, stats
