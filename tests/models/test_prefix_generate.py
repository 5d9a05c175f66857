"""Prefix states and generation from them: the LM's state after each prompt prefix (one forward)
equals the state a forward over that prefix ends in; generation continuing from a cached prefix
equals generation from the whole prompt; EOS stops each row; bad positions name the argument."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdn_jax.models import LanguageModel, model_config
from kdn_jax.models.generate import cache_at, generate

B, T = 2, 11


def _model(pattern, seed=0):
  cfg = model_config("tiny", layer_pattern=pattern, chunk_size=4)
  return cfg, LanguageModel(cfg, rngs=nnx.Rngs(seed))


def _tokens(vocab, seed=0, t=T):
  return jax.random.randint(jax.random.key(seed), (B, t), 0, vocab, jnp.int32)


def test_prefix_states_equal_forward_on_the_prefix():
  """Every layer's state (memory, variance, conv caches; a KDN and a delta-rule layer) after
  prefixes at a chunk end (4), inside a chunk just after a reset (7; row 1: no reset) and at T,
  with packed segments, against the forward on tokens[:, :p]; logits too."""
  cfg, model = _model("kdn_diag,kda")
  tokens = _tokens(cfg.vocab_size)
  seg = jnp.asarray(np.array([[0] * 6 + [1] * 5, [0] * 11]), jnp.int32)
  positions = np.array([4, 7, 11])

  @nnx.jit
  def run(m, tokens, seg):
    at = m.prefix_states(tokens, positions, segment_ids=seg)
    full = [m(tokens[:, :p], segment_ids=seg[:, :p]) for p in positions]
    return at, full

  (logits, caches), full = run(model, tokens, seg)
  assert logits.shape == (B, len(positions), cfg.vocab_size)
  for i, (lg, states) in enumerate(full):
    np.testing.assert_allclose(logits[:, i], lg[:, -1], atol=1e-5, rtol=1e-5)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
      cache_at(caches, i),
      states,
    )


def test_generation_from_cached_prefix_equals_whole_prompt():
  """Prefix states of one forward, then generation continuing after prefix p (with the prompt's
  rest, and from the prefix's logits when p = T) equals generation from the whole prompt."""
  cfg, model = _model("kdn_diag,kdn_iso", seed=1)
  prompt = _tokens(cfg.vocab_size, seed=2)
  want = generate(model, prompt, 5)
  logits, caches = nnx.jit(lambda m, t: m.prefix_states(t, np.array([6, T])))(model, prompt)
  at6 = cache_at(caches, 0)
  mid = generate(model, prompt[:, 6:], 5, cache=at6)
  np.testing.assert_array_equal(mid[:, T - 6 :], want[:, T:])
  cache = cache_at(caches, 1)
  end = generate(model, prompt[:, :0], 5, cache=cache, last_logits=logits[:, 1])
  np.testing.assert_array_equal(end, want[:, T:])
  # the caller's cache is read, not consumed (no donation of it): a second call sees it intact
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((cache, at6)))
  again = generate(model, prompt[:, :0], 5, cache=cache, last_logits=logits[:, 1])
  np.testing.assert_array_equal(again, end)


@pytest.mark.parametrize("every", [2, 16])
def test_generation_stops_at_eos_per_row(every):
  """EOS checked every 2 tokens (full blocks, then a tail) or once (a tail only): the same
  tokens as the unstopped run up to each row's EOS, pad after it."""
  cfg, model = _model("kdn_diag,kdn_iso", seed=1)
  prompt = _tokens(cfg.vocab_size, seed=2)
  free = generate(model, prompt, 6)
  eos = int(free[0, T + 2])  # row 0 emits it as its third token
  out, stats = generate(
    model, prompt, 6, eos_id=eos, pad_id=-1, return_stats=True, eos_check_every=every
  )
  for row in range(B):
    gen = np.asarray(free[row, T:])
    stop = int(np.argmax(gen == eos)) + 1 if np.any(gen == eos) else len(gen)
    np.testing.assert_array_equal(out[row, T : T + stop], gen[:stop])
    assert np.all(np.asarray(out[row, T + stop :]) == -1)
    assert stats.generated[row] == stop
  assert stats.tokens_per_s > 0 and stats.time_to_first_token_s > 0
  with pytest.raises(ValueError, match="generate: eos_check_every must be >= 1"):
    generate(model, prompt, 6, eos_check_every=0)


def test_decode_loop_has_no_data_dependent_loop_without_eos():
  """Without EOS the token loop has a fixed trip count (a scan: no condition read back to the
  host per token); with EOS one while loop runs blocks of fixed-trip scans."""
  gen = importlib.import_module("kdn_jax.models.generate")  # (the package exports the function)

  cfg, model = _model("kdn_diag", seed=1)
  graphdef, state = nnx.split(model)
  first = jnp.zeros((B,), jnp.int32)
  cache = model.init_cache(B, 8)
  kw = dict(max_new_tokens=9, temperature=0.0, top_k=None, pad_id=0, eos_check_every=4)
  trace = lambda eos: str(
    jax.make_jaxpr(
      lambda s, f, c, r: gen._decode_loop(graphdef, s, f, c, r, eos_id=eos, **kw)  # pylint: disable=protected-access
    )(state, first, cache, jax.random.key(0))
  )
  free, stopping = trace(None), trace(3)
  assert " while[" not in free and "scan[" in free
  assert stopping.count(" while[") == 1 and "scan[" in stopping


def test_prefix_states_bad_positions_name_the_argument():
  cfg, model = _model("kdn_diag,kdn_iso")
  tokens = _tokens(cfg.vocab_size)
  with pytest.raises(ValueError, match=r"prefix_states: output_states_at must lie in \[1, T\]"):
    model.prefix_states(tokens, [0, 3])
  with pytest.raises(NotImplementedError, match="mixer 'swa'"):
    _model("kdn_diag,swa")[1].prefix_states(tokens, [3])
