r"""Decode timing: one recurrent step of diag KDN, iso KDN and KDA against fla's fused_recurrent_kda,
and whole-model generation of the 125M LM.

Step rows (B in --batches, H = 16, K = V = 128, fp32 state, bf16 activations): `<op>_xla` is the
op's `*_step` (kdn_jax.ops) and `<op>_pallas` the fused Pallas decode step (pallas_kernels.decode,
when importable); `fla_fused_recurrent_kda` is fla's Triton kernel in PyTorch on the same shapes,
--steps calls per timing (captured in one CUDA graph when capture works, else launched eagerly:
the JSON says which). --step_inputs says how the JAX rows run their --steps steps in one jitted
call with the state donated: 'unrolled' (default) a straight chain of steps, each with its own
input buffers, as fla's graph replays them (the kernel's own cost: nothing else runs per step);
'scan' a lax.scan over stacked inputs (adds the loop's and the per-step input slices' kernels).
Reported per row: us per step, the state bandwidth achieved (the state read and written once:
2 B H K V x 4 bytes, the floor of any decode step; the KDN variance adds 2 B H K x 4) and its share
of the device's HBM bandwidth (HBM_TBPS), i.e. the floor's time over the step's.

Sweep: --block_v and --num_warps (lists) time the --sweep_rows (default diag_kdn_pallas) once per
DecodeConfig(block_v, num_warps) pair; the other rows run the tuned config
(pallas_kernels/tuned.py).

Generation rows: the LM of --lm_config (random weights: speed only) with each impl of --lm_impls
('auto': the XLA decode step; 'pallas': the fused one; the prefill is the chunked Pallas path on a
GPU either way) at batch --lm_batches, a prompt of --prompt_len tokens, --new_tokens greedy tokens
(no EOS): time to first token (the prefill), tokens per second and ms per token, from a second
`generate` call (the first compiles).

--profile_dir: also records a jax.profiler trace of one timed call per step row (and of one
`generate` call per generation row, with a 1-token prompt) under <profile_dir>/<row>_B<b>, and
reports kernels per step / per token and their summed device time from it
(experiments/benchmarks/kernel_dev/profile_layer.py's parser): the launches per token that
separate a step's kernel time from its wall time.

GPU (device tool, carry=[".whl"]; fla, fla_core and ml_collections come as wheels):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m experiments.benchmarks.decode \
      --out=$OUT/decode --block_v=8,16,32 --num_warps=1,2,4 --profile_dir=$OUT/decode_traces \
      --time_budget_s=420

CPU smoke (what tests/benchmarks/test_benchmark_decode.py runs): --batches=1,2 --heads=2 --dim=16
--steps=4 --reps=1 --lm_config=configs/lm_125m.py:smoke --lm_batches=1 --prompt_len=16
--new_tokens=4.

Writes <out>.json and <out>.md after every cell.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from experiments.benchmarks.timing import import_for_cuda, markdown_table
from experiments.runner import cli

FLAGS = flags.FlagValues()
flags.DEFINE_string(
  "out", "/tmp/benchmark_decode", "output path prefix (<out>.json, <out>.md)", flag_values=FLAGS
)
flags.DEFINE_list("batches", ["1", "16", "64", "256"], "decode batch sizes", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "heads", flag_values=FLAGS)
flags.DEFINE_integer("dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer("steps", 64, "decode steps per timed call", flag_values=FLAGS)
flags.DEFINE_integer("reps", 20, "timed calls (median reported)", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "untimed calls after compilation", flag_values=FLAGS)
flags.DEFINE_enum(
  "step_inputs",
  "unrolled",
  ["unrolled", "scan"],
  "how the JAX step rows run their steps (see the module docstring)",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "block_v", [], "DecodeConfig.block_v values to sweep (empty: the tuned one)", flag_values=FLAGS
)
flags.DEFINE_list(
  "num_warps",
  [],
  "DecodeConfig.num_warps values to sweep (empty: the tuned one)",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "sweep_rows",
  ["diag_kdn_pallas"],
  "pallas rows the block_v / num_warps sweep times",
  flag_values=FLAGS,
)
flags.DEFINE_list(
  "lm_impls", ["auto", "pallas"], "model impls of the generation rows", flag_values=FLAGS
)
flags.DEFINE_string(
  "profile_dir", "", "record a profiler trace per row here and count its kernels", flag_values=FLAGS
)
flags.DEFINE_list(
  "rows",
  [
    "diag_kdn_xla",
    "iso_kdn_xla",
    "kda_xla",
    "diag_kdn_pallas",
    "iso_kdn_pallas",
    "kda_pallas",
    "fla_fused_recurrent_kda",
  ],
  "step rows to time (pallas and fla rows are skipped where unavailable)",
  flag_values=FLAGS,
)
flags.DEFINE_string(
  "lm_config",
  "configs/lm_125m.py:default",
  "config file:arg of the generation rows ('' skips them)",
  flag_values=FLAGS,
)
flags.DEFINE_list("lm_batches", ["1", "64"], "generation batch sizes", flag_values=FLAGS)
flags.DEFINE_integer("prompt_len", 2048, "generation prompt length", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 256, "tokens generated per row", flag_values=FLAGS)
flags.DEFINE_float(
  "time_budget_s", 270.0, "start no new cell after this many seconds", flag_values=FLAGS
)

# HBM bandwidth in TB/s by device kind (substring of jax's device_kind, first match).
HBM_TBPS = (("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8))


def hbm_tbps(device_kind: str):
  """The HBM bandwidth of a device kind (TB/s), or None when not in HBM_TBPS (e.g. a CPU)."""
  for name, tbps in HBM_TBPS:
    if name in device_kind:
      return tbps
  return None


def state_bytes(row: str, b: int, h: int, d: int) -> int:
  """Bytes of one step's state read (and again written): fp32 memory, plus the KDN variance."""
  n = b * h * d * d * 4
  if row.startswith("diag_kdn"):
    n += b * h * d * 4
  elif row.startswith("iso_kdn"):
    n += b * h * 4
  return n


# ----------------------------------------------------------------------------------- JAX rows


def _step_inputs(key, steps, b, h, d):
  """Per-step bf16 activations [steps, B, H, ...] (unit-norm q, k) and the fp32 states."""
  ks = jax.random.split(key, 8)
  bf = jnp.bfloat16
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  shp = (steps, b, h, d)
  x = dict(
    q=l2(jax.random.normal(ks[0], shp)).astype(bf),
    k=l2(jax.random.normal(ks[1], shp)).astype(bf),
    v=jax.random.normal(ks[2], shp).astype(bf),
    la=(-0.1 * jax.nn.softplus(jax.random.normal(ks[3], shp))).astype(bf),
    om=(0.1 * jax.nn.softplus(jax.random.normal(ks[4], shp))).astype(bf),
    r=(0.01 + jax.nn.softplus(jax.random.normal(ks[5], shp[:3]))).astype(bf),
    beta=jax.nn.sigmoid(jax.random.normal(ks[6], shp[:3])).astype(bf),
  )
  x["om_iso"] = x["om"][..., 0]
  memory = 0.1 * jax.random.normal(ks[7], (b, h, d, d), jnp.float32)
  return x, memory


def step_fn(row: str, decode_config=None):
  """(one step (state, x_t) -> (state, o_t), initial state from memory) of a JAX row; a pallas
  row runs `decode_config` (a DecodeConfig; None: the tuned one)."""
  from kdn_jax import ops  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tuned import KernelConfigs  # pylint: disable=g-import-not-at-top

  op, impl = row.rsplit("_", 1)
  if op not in ("diag_kdn", "iso_kdn", "kda") or impl not in ("xla", "pallas"):
    raise ValueError(
      f"--rows: unknown step row {row!r}; expected <diag_kdn|iso_kdn|kda>_<xla|pallas> "
      "or fla_fused_recurrent_kda"
    )
  kw = {} if impl == "xla" else {"impl": "pallas"}
  if impl == "pallas" and decode_config is not None:
    kw["kernel_config"] = KernelConfigs(decode=decode_config)
  if op in ("diag_kdn", "iso_kdn"):
    diag = op == "diag_kdn"
    fn = ops.diag_kdn_step if diag else ops.iso_kdn_step

    def step(state, x):
      o, state = fn(
        x["q"], x["k"], x["v"], x["la"], x["om"] if diag else x["om_iso"], x["r"], state, **kw
      )
      return state, o

    def init(memory):
      var_shape = memory.shape[:3] if diag else memory.shape[:2]
      return ops.KDNState(memory, jnp.ones(var_shape, jnp.float32))

    return step, init

  def step(memory, x):
    o, memory = ops.kda_step(x["q"], x["k"], x["v"], x["la"], x["beta"], memory, **kw)
    return memory, o

  return step, lambda memory: memory


def jax_steps_fn(row, b, h, d, steps, step_inputs, decode_config=None):
  """(jitted call running `steps` decode steps with the state donated, its first state, its
  inputs) of a JAX row."""
  step, init = step_fn(row, decode_config)
  xs, memory = _step_inputs(jax.random.key(0), steps, b, h, d)
  if step_inputs == "scan":
    run = jax.jit(lambda state, xs: jax.lax.scan(step, state, xs), donate_argnums=(0,))
    return run, init(memory), xs
  # every step's inputs their own buffers (as fla's calls get them): no slice op per step
  per_step = [jax.tree.map(lambda a, t=t: a[t], xs) for t in range(steps)]

  def chain(state, per_step):
    outs = []
    for x in per_step:
      state, o = step(state, x)
      outs.append(o)
    return state, outs

  return jax.jit(chain, donate_argnums=(0,)), init(memory), per_step


CALLS_PER_SAMPLE = 4


def time_jax_row(row, b, h, d, steps, reps, warmup, step_inputs="unrolled", decode_config=None):
  """Median ms of one jitted call running `steps` decode steps (state carried, donated), and the
  call (with its live state) for a profiler trace."""
  run, state, xs = jax_steps_fn(row, b, h, d, steps, step_inputs, decode_config)
  for _ in range(1 + warmup):
    state, o = run(state, xs)
  jax.block_until_ready((state, o))
  times = []
  for _ in range(reps):
    # CALLS_PER_SAMPLE calls queued back to back: the host's dispatch of a call overlaps the
    # device's run of the one before, as fla's timing (device events) has no dispatch in it
    start = time.perf_counter()
    for _ in range(CALLS_PER_SAMPLE):
      state, o = run(state, xs)
    jax.block_until_ready((state, o))
    times.append((time.perf_counter() - start) * 1e3 / CALLS_PER_SAMPLE)
  box = [state]

  def again():
    box[0], o = run(box[0], xs)
    jax.block_until_ready((box[0], o))

  return statistics.median(times), {}, again


def profile_call(fn, logdir, iters):
  """Kernels per iteration and their device time (ms) in a profiler trace of one fn() call that
  runs `iters` steps / tokens (kernel_dev.profile_layer's parser; on CPU: the host's XLA ops)."""
  from experiments.benchmarks.kernel_dev import profile_layer  # pylint: disable=g-import-not-at-top

  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    fn()
  prof = profile_layer.parse_trace(profile_layer.find_trace(logdir), iters)
  return {
    "trace": prof["trace"],
    "trace_mode": prof["mode"],
    "kernels_per_step": sum(k["calls_per_iter"] for k in prof["kernels"]),
    "kernel_ms_per_step": prof["total_device_ms"],
    "top_kernels": [
      {"name": k["name"][:120], "calls": k["calls_per_iter"], "ms": k["ms"]}
      for k in prof["kernels"][:8]
    ],
  }


def check_against_xla(row, b, h, d, steps, decode_config=None):
  """A Pallas row's relative errors against its XLA step after `steps` steps from one state: the
  final state (memory) and the outputs (bf16)."""
  xs, memory = _step_inputs(jax.random.key(1), steps, b, h, d)
  outs = []
  for r in (row, row.replace("_pallas", "_xla")):
    step, init = step_fn(r, decode_config if r == row else None)
    state, o = jax.jit(lambda state, xs, step=step: jax.lax.scan(step, state, xs))(init(memory), xs)
    outs.append((np.asarray(jax.tree.leaves(state)[0], np.float64), np.asarray(o, np.float64)))
  rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return {
    "rel_err_state_vs_xla": rel(outs[0][0], outs[1][0]),
    "rel_err_o_vs_xla": rel(outs[0][1], outs[1][1]),
  }


def pallas_decode_available(allow_interpret: bool = False) -> bool:
  """Whether the *_pallas rows run: the fused decode kernels import, on a GPU (or anywhere with
  allow_interpret: interpret mode, for the CPU test)."""
  try:
    importlib.import_module("pallas_kernels.decode")
  except ImportError:
    return False
  return allow_interpret or jax.default_backend() == "gpu"


# ----------------------------------------------------------------------------------- fla row


def _fla_fused_recurrent():
  mods, reason = import_for_cuda("fla.ops.kda")
  if mods is None:
    logging.warning("fla unavailable: %s", reason)
    return None
  return mods[0], mods[1].fused_recurrent_kda


def time_fla_row(b, h, d, steps, reps, warmup):
  """Median ms of `steps` calls of fla's fused_recurrent_kda (T = 1 each, state updated in place
  where the installed fla offers it), one CUDA graph when capture works."""
  torch, fused = _fla_fused_recurrent()
  g = torch.Generator(device="cuda").manual_seed(0)
  rn = lambda *s: torch.randn(*s, device="cuda", generator=g)
  l2 = lambda z: z / z.norm(dim=-1, keepdim=True)
  bf = torch.bfloat16
  xs = [
    dict(
      q=l2(rn(b, 1, h, d)).to(bf),
      k=l2(rn(b, 1, h, d)).to(bf),
      v=rn(b, 1, h, d).to(bf),
      g=(-0.1 * torch.nn.functional.softplus(rn(b, 1, h, d))).float(),
      beta=torch.sigmoid(rn(b, 1, h)).to(bf),
    )
    for _ in range(steps)
  ]
  state = 0.1 * rn(b, h, d, d)
  inplace = {"inplace_final_state": True}
  try:
    fused(**xs[0], scale=d**-0.5, initial_state=state.clone(), output_final_state=True, **inplace)
  except TypeError:
    inplace = {}

  def run():
    s = state
    for x in xs:
      _, fin = fused(**x, scale=d**-0.5, initial_state=s, output_final_state=True, **inplace)
      s = s if inplace else fin

  for _ in range(1 + warmup):
    run()
  torch.cuda.synchronize()
  mode = "eager"
  try:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      run()
    fn, mode = graph.replay, "cuda_graph"
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("fla: CUDA graph capture failed (%s); timing eager launches", e)
    fn = run
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))

  def again():
    fn()
    torch.cuda.synchronize()

  return statistics.median(times), {"launch": mode, "inplace_state": bool(inplace)}, again


# ------------------------------------------------------------------------------- generation


def load_lm_config(spec: str):
  """'path/to/config.py:arg' -> the config's model ConfigDict."""
  path, _, arg = spec.partition(":")
  spec_ = importlib.util.spec_from_file_location("decode_lm_config", path)
  mod = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(mod)
  return mod.get_config(arg or "default").model


def time_generation(spec, batch, prompt_len, new_tokens, impl="auto", profile_dir=""):
  """GenerationStats of the second generate call (the first compiles) for a random-weight LM built
  with `impl`, and with profile_dir the kernels per token of a traced generate call from a
  1-token prompt (its prefill adds about one token's kernels)."""
  from kdn_jax.models import LanguageModel  # pylint: disable=g-import-not-at-top
  from kdn_jax.models.generate import generate  # pylint: disable=g-import-not-at-top

  cfg = load_lm_config(spec)
  cfg.impl = impl
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  prompt = jax.random.randint(
    jax.random.key(1), (batch, prompt_len), 0, int(cfg.vocab_size), jnp.int32
  )
  generate(model, prompt, new_tokens, return_stats=True)
  _, stats = generate(model, prompt, new_tokens, return_stats=True)
  if not profile_dir:
    return stats, {}
  short = prompt[:, :1]
  generate(model, short, new_tokens)  # compiled outside the trace
  prof = profile_call(lambda: generate(model, short, new_tokens), profile_dir, new_tokens)
  return stats, {
    "kernels_per_token": prof["kernels_per_step"],
    "kernel_ms_per_token": prof["kernel_ms_per_step"],
    "trace": prof["trace"],
    "top_kernels": prof["top_kernels"],
  }


# ------------------------------------------------------------------------------------ output


def _cfg_label(r):
  return "%d / %d" % (r["block_v"], r["num_warps"]) if "block_v" in r else "-"


def _write(out, results):
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  lines = [f"# Decode ({results['device']})", ""]
  if results["steps"]:
    lines += [
      "One decode step (fp32 state, bf16 activations, H = %d, K = V = %d, JAX steps %s); HBM "
      "share: the state read and written once at %s TB/s over the step's time."
      % (results["heads"], results["dim"], results["step_inputs"], results["hbm_tbps"]),
      "",
    ]
    rows = [
      [
        r["row"],
        r["batch"],
        _cfg_label(r),
        "%.2f" % r["us_per_step"],
        "%.0f" % r["gbps"],
        "-" if r["floor_us"] is None else "%.2f" % r["floor_us"],
        "-" if r["hbm_share"] is None else "%.0f%%" % (100 * r["hbm_share"]),
        "%g" % r["kernels_per_step"] if "kernels_per_step" in r else "-",
        r.get("launch", results["step_inputs"]),
        "%.1e" % r["rel_err_state_vs_xla"] if "rel_err_state_vs_xla" in r else "-",
      ]
      for r in results["steps"]
      if "us_per_step" in r
    ]
    lines += [
      markdown_table(
        [
          "row",
          "B",
          "block_v / warps",
          "us / step",
          "state GB/s",
          "floor us",
          "HBM share",
          "kernels / step",
          "launch",
          "state err vs XLA",
        ],
        rows,
      ),
      "",
    ]
    fails = [r for r in results["steps"] if "error" in r]
    lines += [f"- {r['row']} B={r['batch']}: {r['error']}" for r in fails]
  if results["generation"]:
    lines += ["", f"Generation ({results['lm_config']}, random weights, greedy, no EOS).", ""]
    rows = [
      [
        g["impl"],
        g["batch"],
        g["prompt_len"],
        g["new_tokens"],
        "%.3f" % g["time_to_first_token_s"],
        "%.1f" % g["tokens_per_s"],
        "%.1f" % g["decode_tokens_per_s"],
        "%.2f" % (1e3 * g["decode_s"] / max(g["new_tokens"] - 1, 1)),
        "%g" % g["kernels_per_token"] if "kernels_per_token" in g else "-",
      ]
      for g in results["generation"]
      if "tokens_per_s" in g
    ]
    lines += [
      markdown_table(
        [
          "impl",
          "B",
          "prompt",
          "new",
          "TTFT s",
          "tokens/s",
          "decode tokens/s",
          "ms / decode step",
          "kernels / token",
        ],
        rows,
      ),
      "",
    ]
    lines += [
      f"- {g['impl']} B={g['batch']}: {g['error']}" for g in results["generation"] if "error" in g
    ]
  with open(out + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def sweep_configs(row, sweep_rows, block_v, num_warps):
  """The DecodeConfigs a swept pallas row is also timed with: every (block_v, num_warps) pair (an
  empty list: the tuned value); [] for other rows (they run the tuned config only)."""
  from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

  if not row.endswith("_pallas") or row not in sweep_rows or not (block_v or num_warps):
    return []
  base = tuned.tuned("decode")
  return [
    dataclasses.replace(base, block_v=bv, num_warps=nw)
    for bv in (block_v or [base.block_v])
    for nw in (num_warps or [base.num_warps])
  ]


def _step_cell(row, b, cfg, results, opts):
  """One step row at batch b (cfg: its DecodeConfig, or None): the record for the JSON."""
  heads, dim, steps = results["heads"], results["dim"], results["steps_per_call"]
  rec = dict(row=row, batch=b)
  if row.endswith("_pallas"):
    from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

    used = cfg or tuned.tuned("decode")
    rec.update(block_v=min(used.block_v, dim), num_warps=used.num_warps)
  if row.startswith("fla"):
    ms, extra, again = time_fla_row(b, heads, dim, steps, opts["reps"], opts["warmup"])
  else:
    ms, extra, again = time_jax_row(
      row, b, heads, dim, steps, opts["reps"], opts["warmup"], results["step_inputs"], cfg
    )
    if row.endswith("_pallas"):
      extra = dict(extra, **check_against_xla(row, b, heads, dim, steps, cfg))
  us = 1e3 * ms / steps
  nbytes = 2 * state_bytes(row if not row.startswith("fla") else "kda", b, heads, dim)
  tbps = results["hbm_tbps"]
  floor = None if tbps is None else nbytes / (tbps * 1e6)
  rec.update(
    extra,
    us_per_step=us,
    state_bytes_moved=nbytes,
    gbps=nbytes / (us * 1e3),
    floor_us=floor,
    hbm_share=None if floor is None else floor / us,
  )
  if opts["profile_dir"]:
    tag = row + ("" if cfg is None else f"_bv{cfg.block_v}_w{cfg.num_warps}") + f"_B{b}"
    rec.update(profile_call(again, os.path.join(opts["profile_dir"], tag), steps))
  return rec


def run(
  out,
  batches,
  heads,
  dim,
  steps,
  reps,
  warmup,
  rows,
  lm_config,
  lm_batches,
  prompt_len,
  new_tokens,
  time_budget_s,
  pallas_interpret=False,
  step_inputs="unrolled",
  block_v=(),
  num_warps=(),
  sweep_rows=("diag_kdn_pallas",),
  lm_impls=("auto", "pallas"),
  profile_dir="",
):
  t_start = time.time()
  kind = jax.devices()[0].device_kind
  results = dict(
    device=kind,
    hbm_tbps=hbm_tbps(kind),
    heads=heads,
    dim=dim,
    steps_per_call=steps,
    step_inputs=step_inputs,
    steps=[],
    generation=[],
    lm_config=lm_config,
  )
  opts = dict(reps=reps, warmup=warmup, profile_dir=profile_dir)
  have_pallas = pallas_decode_available(pallas_interpret)
  have_fla = any(r.startswith("fla") for r in rows) and _fla_fused_recurrent() is not None
  runs = [
    r
    for r in rows
    if not (r.endswith("_pallas") and not have_pallas)
    and not (r.startswith("fla") and not have_fla)
  ]

  def spent(what):
    if time.time() - t_start > time_budget_s:
      logging.warning("time budget spent: skipping %s", what)
      return True
    return False

  def step_cell(row, b, cfg):
    try:
      rec = _step_cell(row, b, cfg, results, opts)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rec = dict(row=row, batch=b, error=f"{type(e).__name__}: {e}"[:300])
    print(rec, flush=True)
    results["steps"].append(rec)
    _write(out, results)

  # In order of importance, so that a spent budget cuts the sweep first: every row at its tuned
  # config, then generation, then the sweep's other configs.
  for b in batches:
    for row in runs:
      if not spent(f"{row} B={b}"):
        step_cell(row, b, None)
  for impl in lm_impls if lm_config else []:
    for b in lm_batches:
      if spent(f"generation {impl} B={b}"):
        continue
      rec = dict(impl=impl, batch=b, prompt_len=prompt_len, new_tokens=new_tokens)
      try:
        pdir = os.path.join(profile_dir, f"generate_{impl}_B{b}") if profile_dir else ""
        stats, prof = time_generation(lm_config, b, prompt_len, new_tokens, impl, pdir)
        rec.update(
          prof,
          time_to_first_token_s=stats.time_to_first_token_s,
          decode_s=stats.decode_s,
          tokens_per_s=stats.tokens_per_s,
          decode_tokens_per_s=stats.decode_tokens_per_s,
          ms_per_token=1e3 * stats.decode_s / max(new_tokens - 1, 1),
        )
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
      print(rec, flush=True)
      results["generation"].append(rec)
      _write(out, results)
  if any(sweep_configs(r, sweep_rows, list(block_v), list(num_warps)) for r in runs):
    from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

    base = tuned.tuned("decode")
    for b in batches:
      for row in runs:
        for cfg in sweep_configs(row, sweep_rows, list(block_v), list(num_warps)):
          if cfg != base and not spent(f"{row} B={b} block_v={cfg.block_v} warps={cfg.num_warps}"):
            step_cell(row, b, cfg)
  _write(out, results)
  return results


def main(argv):
  del argv
  ints = lambda xs: [int(x) for x in xs]
  run(
    FLAGS.out,
    ints(FLAGS.batches),
    FLAGS.heads,
    FLAGS.dim,
    FLAGS.steps,
    FLAGS.reps,
    FLAGS.warmup,
    list(FLAGS.rows),
    FLAGS.lm_config,
    ints(FLAGS.lm_batches),
    FLAGS.prompt_len,
    FLAGS.new_tokens,
    FLAGS.time_budget_s,
    step_inputs=FLAGS.step_inputs,
    block_v=ints(FLAGS.block_v),
    num_warps=ints(FLAGS.num_warps),
    sweep_rows=list(FLAGS.sweep_rows),
    lm_impls=list(FLAGS.lm_impls),
    profile_dir=FLAGS.profile_dir,
  )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
