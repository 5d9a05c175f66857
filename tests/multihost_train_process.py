"""One of the 2 jax.distributed CPU processes of test_runner.test_two_process_training_survives_a_kill.

argv: process_id, coordinator port, base dir, phase. Phase 'first': check the host-side parameter init
(every process holds exactly its shards of the seed's values), train workdir a uninterrupted, then train
workdir b and SIGKILL this process in the middle of step 6 (rows 1-5 logged, last checkpoint step 4).
Phase 'resume': rerun workdir b, which resumes from step 4; process 1 alone gets SIGTERM during its
second step, and both processes must stop at one agreed step, saving it. Prints 'status <status> <step>'
after each run."""

import os
import signal
import sys
import time

pid, port, base, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(coordinator_address="127.0.0.1:" + port, num_processes=2, process_id=pid)

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_helpers import tiny_config  # pylint: disable=g-import-not-at-top

from experiments.runner import trainer  # pylint: disable=g-import-not-at-top

assert jax.process_count() == 2 and len(jax.devices()) == 2 and len(jax.local_devices()) == 1


def check_host_init():
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())

  def init():
    return {"w": jax.random.normal(jax.random.key(0), (4, 6)), "b": jnp.float32(3.0)}

  out = trainer._host_init(init, {"w": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P())})
  ref = np.asarray(jax.random.normal(jax.random.key(0), (4, 6)))
  (shard,) = out["w"].addressable_shards  # one of the two row blocks, not the whole array
  assert shard.data.shape == (2, 6)
  np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=1e-6)
  assert float(out["b"].addressable_shards[0].data) == 3.0


def config():
  c = tiny_config(
    "state_passing"
  )  # a carried state too: it is sharded over the two processes' rows
  c.train.state_reset_prob = 0.3
  c.checkpoint.enabled = True
  c.checkpoint.every_steps = 2
  c.train.num_steps = 12
  return c


def train(workdir, kill_at_call=None, term_at_call=None):
  tr = trainer.Trainer(config(), os.path.join(base, workdir))
  calls, inner = [0], tr.train_step

  def step(local):
    calls[0] += 1
    if calls[0] == kill_at_call:
      os.kill(os.getpid(), signal.SIGKILL)  # no handler, no cleanup: like a lost host
    if calls[0] == term_at_call:
      os.kill(os.getpid(), signal.SIGTERM)
    if phase == "resume" and calls[0] > 2:
      # The notice reaches the other process through the coordination service asynchronously; slow
      # steps keep the agreed step before num_steps even on a loaded machine.
      time.sleep(0.5)
    return inner(local)

  tr.train_step = step
  s = tr.run()
  print("status", s["status"], s["step"], flush=True)
  tr.close()


if phase == "first":
  check_host_init()
  train("a")
  train("b", kill_at_call=6)
else:  # only process 1 gets SIGTERM: both must stop (and save) at one agreed step
  train("b", term_at_call=2 if pid == 1 else None)
