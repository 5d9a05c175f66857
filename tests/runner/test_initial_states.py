"""Carry-forward initial states: state passing, TBTT, fitted noise, random noise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from runner_helpers import host, tiny_config, write_doc_tokens

from experiments.runner import initial_states as init_lib
from experiments.runner import trainer


def _manual_final(tr, params, local, init):
  """Final states of one forward pass from explicit initial states (reference for the carry)."""
  model = tr.merge(params, tr.rest)
  _, final = model(jnp.asarray(local["inputs"]), states=init)
  return final


def _check_carry_chain(tr, steps=3):
  """Step n+1 starts from final(step n) except reset rows; the carried state is what the model produced."""
  b = tr.config.data.global_batch_size
  resets = []
  for n in range(steps):
    params = host(tr.state["params"])
    prev_carry = host(tr.state["carry"])
    valid = bool(tr.state["carry_valid"])
    local = next(tr.data_iter)
    tr.train_step(local)
    reset = np.asarray(tr.last_reset)
    if n == 0:
      assert reset.all() and not valid  # first step: everything starts from the normal start
    resets.append(reset)
    default = tr.merge(params, tr.rest).init_states(b)
    init = init_lib.select_rows(jnp.asarray(reset), default, prev_carry)
    expect = _manual_final(tr, params, local, init)
    got = host(tr.state["carry"])
    for e, g in zip(jax.tree.leaves(expect), jax.tree.leaves(got)):
      np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)
    assert got[1] is None  # attention layers carry nothing
  return resets


def test_state_passing_carry_and_reset_rate(tmp_path):
  c = tiny_config("state_passing")
  c.train.state_reset_prob = 0.5
  tr = trainer.Trainer(c, str(tmp_path))
  resets = _check_carry_chain(tr, steps=3)
  assert 0 < np.mean(np.concatenate(resets[1:])) < 1
  tr.close()
  # Reset rate of the sampler itself, on many rows.
  default = [{"memory": jnp.zeros((20000, 1, 1, 1)), "variance": jnp.ones((20000, 1, 1))}, None]
  carry = [{"memory": jnp.ones((20000, 1, 1, 1)), "variance": 2 * jnp.ones((20000, 1, 1))}, None]
  init, reset = init_lib.initial_states(
    "state_passing", default, key=jax.random.PRNGKey(0), carry=carry, reset_prob=0.1
  )
  assert abs(float(reset.mean()) - 0.1) < 0.01
  np.testing.assert_array_equal(np.asarray(init[0]["memory"][:, 0, 0, 0]), 1.0 - np.asarray(reset))
  np.testing.assert_array_equal(np.asarray(init[0]["variance"][:, 0, 0]), 2.0 - np.asarray(reset))


def test_carried_state_is_stop_gradient():
  default = [{"memory": jnp.zeros((4, 2, 3, 3))}]

  def f(c):
    init = init_lib.select_rows(jnp.array([True, False, False, True]), default, [{"memory": c}])
    return jnp.sum(init[0]["memory"] ** 2)

  g = jax.grad(f)(jnp.ones((4, 2, 3, 3)))
  np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_tbtt_hands_state_to_next_chunk_of_same_document(tmp_path):
  path = str(tmp_path / "docs.npy")
  write_doc_tokens(path, num_docs=24, eos=1, vocab=32, min_len=10, max_len=50)
  c = tiny_config("tbtt", kind="token_file", train_path=path, eos_id=1)
  tr = trainer.Trainer(c, str(tmp_path / "w"))
  resets = _check_carry_chain(tr, steps=3)
  # Some slots continue their document (no reset) after the first step.
  assert not np.concatenate(resets[1:]).all()
  tr.close()


def test_tbtt_loader_slots_are_consecutive_chunks(tmp_path):
  from experiments.data import token_files

  path = str(tmp_path / "docs.npy")
  write_doc_tokens(path, num_docs=12, eos=1, vocab=32)
  tokens = np.load(path)
  src = token_files.TBTTSource(tokens, 1, 8, 4, seed=0)
  for slot in range(4):
    stream = []
    for n in range(len(src)):
      ex = src[n]
      if ex["reset"][slot] and stream:
        # the previous document ended exactly at the previous chunk (its last target was eos)
        assert stream[-1][-1] == 1
        stream = []
      m = ex["mask"][slot].astype(bool)
      # chunks of one document are contiguous: this chunk's first input is the last target before it
      if stream:
        assert ex["inputs"][slot][0] == stream[-1][-1]
      stream.append(ex["targets"][slot][m])
    assert len(src) > 3


def test_fitted_noise_statistics_update(tmp_path):
  rng = np.random.default_rng(0)

  def states(scale):
    return [
      {
        "memory": jnp.asarray(scale * rng.normal(size=(6, 2, 3, 4)), jnp.float32),
        "variance": jnp.asarray(np.exp(rng.normal(size=(6, 2, 3))), jnp.float32),
        "conv": jnp.zeros((6, 3, 2)),
      },
      None,
    ]

  s1, s2 = states(1.0), states(3.0)
  stats = init_lib.init_fitted_stats(s1)
  stats = init_lib.update_fitted_stats(stats, s1, 0.1)
  stats = init_lib.update_fitted_stats(stats, s2, 0.1)
  for key, tf in (("memory", lambda x: x), ("variance", np.log)):
    x1, x2 = tf(np.asarray(s1[0][key])), tf(np.asarray(s2[0][key]))
    axes = tuple(a for a in range(x1.ndim) if a != 1)
    for stat, fn in (("mean", np.mean), ("var", np.var)):
      expect = 0.9 * fn(x2, axes) + 0.1 * fn(x1, axes)  # 90% current, 10% previous
      np.testing.assert_allclose(
        np.asarray(stats["layers"][0][key][stat]), expect, rtol=1e-5, atol=1e-6
      )
  assert stats["layers"][1] is None
  sample = init_lib.sample_fitted(s1, stats, jax.random.PRNGKey(1))
  assert (np.asarray(sample[0]["variance"]) > 0).all()
  assert sample[0]["memory"].shape == (6, 2, 3, 4)
  np.testing.assert_array_equal(np.asarray(sample[0]["conv"]), 0.0)

  # In the trainer: after one step the statistics are those of that step's final states.
  c = tiny_config("fitted_noise")
  tr = trainer.Trainer(c, str(tmp_path))
  params = host(tr.state["params"])
  local = next(tr.data_iter)
  tr.train_step(local)
  final = _manual_final(tr, params, local, None)  # before the first update the normal start is used
  mean = np.mean(np.asarray(final[0]["memory"]), axis=(0, 2, 3))
  np.testing.assert_allclose(
    np.asarray(tr.state["fstats"]["layers"][0]["memory"]["mean"]), mean, rtol=1e-4, atol=1e-6
  )
  assert int(tr.state["fstats"]["count"]) == 1
  tr.close()


def test_random_noise_only_touches_memory():
  default = [{"memory": jnp.zeros((8, 2, 4, 4)), "variance": jnp.ones((8, 2, 4))}, None]
  init, _ = init_lib.initial_states("random_noise", default, key=jax.random.PRNGKey(0), sigma=0.5)
  assert abs(float(jnp.std(init[0]["memory"])) - 0.5) < 0.1
  np.testing.assert_array_equal(np.asarray(init[0]["variance"]), 1.0)
  assert init[1] is None
