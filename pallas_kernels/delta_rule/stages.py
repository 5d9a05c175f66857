"""How the delta rule runs its kernel stages: `run(name, fn, *arrays, **static)`.

forward_stages and backward_stages (chunk_fwd.py, chunk_bwd.py) and the stage functions they call
(intra.intra_forward, backward.backward) run every stage through a runner of that signature:
arrays (pytrees of arrays or None) go positionally, static arguments by keyword. The op passes
`call`, which just calls the stage. A benchmark passes its own runner to time each stage as the
op runs it, in the op's order and with the op's arguments
(experiments/benchmarks/mixers/timing.py), so there is one stage list, this package's.
"""


def call(name, fn, *arrays, **static):
  """The op's runner: calls the stage."""
  del name
  return fn(*arrays, **static)
