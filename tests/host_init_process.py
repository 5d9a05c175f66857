"""One process of test_runner.test_host_init_two_processes: argv = process_id, coordinator port."""
import sys

pid = int(sys.argv[1])
import jax
jax.config.update('jax_platforms', 'cpu')
jax.distributed.initialize(coordinator_address='127.0.0.1:' + sys.argv[2], num_processes=2, process_id=pid)
import numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from experiments import trainer
mesh = jax.make_mesh((2,), ('x',), devices=jax.devices())
def init():
  k = jax.random.key(0)
  return {'w': jax.random.normal(k, (4, 6)), 'b': jnp.float32(3.0)}
sh = {'w': NamedSharding(mesh, P('x')), 'b': NamedSharding(mesh, P())}
out = trainer._host_init(init, sh)
ref = np.asarray(jax.random.normal(jax.random.key(0), (4, 6)))
for s in out['w'].addressable_shards:
  np.testing.assert_allclose(np.asarray(s.data), ref[s.index], rtol=1e-6)
print('process', pid, 'ok', out['w'].shape, [s.index for s in out['w'].addressable_shards], float(out['b'].addressable_shards[0].data))
