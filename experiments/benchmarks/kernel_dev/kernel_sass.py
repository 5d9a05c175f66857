"""Static report of the Pallas GPU kernels, on a machine without a GPU: one mixers-benchmark row
is lowered for CUDA (jax's cross-platform lowering, as tests/kernels/test_pallas_lowering.py does), each
pallas_call's Triton IR is taken from the lowering and compiled for sm_90 by the `triton` package
(its bundled ptxas), and the SASS is read back (nvdisasm, cuobjdump):

  pip install 'triton>=3.4'   # (or kdn_jax's [sass] extra; not a core dependency)
  python -m experiments.benchmarks.kernel_dev.kernel_sass --row=diag_kdn_pallas --mode=fwd --seq_len=4096 \\
      [--delta_rule_config=field=value/...] [--json=/tmp/sass.json] [--sass_dir=/tmp/sass]

Per kernel: warps, pipeline stages, registers, local (spill) bytes, shared memory, SASS
instructions, and each innermost loop's instructions by kind (MUFU = special-function unit:
exp2, rcp, ...; LDG/STG = global loads/stores; SHFL = warp shuffles of reductions; CALL = libdevice
slow paths). A loop's instruction count per iteration is what a kernel bound by issue pays per
step; it is a proxy, not a timing (the device's numbers are in docs/performance.md).

The device compiles the same Triton IR with the Triton that XLA bundles (jaxlib), not the pip
package, so its SASS can differ in scheduling and registers; what the IR fixes (which math
functions, how many loads, the reductions' shuffles) is the same. How to use it: docs/kernel_dev.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import tempfile

from absl import app, flags

from experiments import kernel_config
from experiments.runner import cli

FLAGS = flags.FlagValues()
flags.DEFINE_string(
  "row",
  "diag_kdn_pallas",
  "a mixers-benchmark JAX row (*_pallas), or "
  "layer:<mixer> for a layers-benchmark layer on the pallas path (width = "
  "heads x dim)",
  flag_values=FLAGS,
)
flags.DEFINE_integer("seq_len", 4096, "T", flag_values=FLAGS)
flags.DEFINE_enum(
  "mode", "fwd", ["fwd", "fwd_bwd"], "forward, or the gradient of a loss on it", flag_values=FLAGS
)
flags.DEFINE_integer("batch", 4, "B", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "H", flag_values=FLAGS)
flags.DEFINE_integer("dim", 128, "K = V per head", flag_values=FLAGS)
flags.DEFINE_integer("compute_capability", 90, "target SM (90: H100 / H200)", flag_values=FLAGS)
flags.DEFINE_string("json", "", "write the report here too", flag_values=FLAGS)
flags.DEFINE_string("sass_dir", "", "write each kernel's SASS here", flag_values=FLAGS)
flags.DEFINE_string(
  "baseline_json",
  "",
  "a --json of an earlier run (another tree or config): also print this run's kernels against it",
  flag_values=FLAGS,
)
kernel_config.define_flags(FLAGS)  # --delta_rule_config, --gain_config, --conv_config


# --------------------------------------------------------------------- Triton IR of a lowering


@contextlib.contextmanager
def captured_triton_modules():
  """Inside the block, every pallas_call lowered for CUDA appends {'name', 'num_warps',
  'num_stages', 'ttir', 'hbm_bytes'} to the yielded list (hbm_bytes: its operands' and results'
  bytes, _hbm_bytes), and the kernels choose what they choose on a GPU
  (pallas_kernels.common.kernel_backend reads 'gpu'). Lower with
  `jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',))`."""
  from jax._src.pallas import core as pallas_core  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import core as triton_core  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top

  from pallas_kernels import common  # pylint: disable=g-import-not-at-top

  found = []
  pending = {}
  # (jax routes a pallas_call with Triton compiler params through its rule registry, one without
  # through the module attribute: both are wrapped)
  rules = pallas_core._backend_lowering_rules  # pylint: disable=protected-access
  saved = (
    registration.pallas_call_lowering,
    registration.lowering.lower_jaxpr_to_triton_module,
    common.kernel_backend,
    rules.get(triton_core.CompilerParams),
  )

  def lowering_rule(ctx, *nodes, compiler_params=None, **params):
    pending["warps"] = getattr(compiler_params, "num_warps", None) or 4
    pending["stages"] = getattr(compiler_params, "num_stages", None) or 3
    pending["name"] = params.get("name")
    pending["hbm_bytes"] = _hbm_bytes(ctx.avals_in) + _hbm_bytes(ctx.avals_out)
    return saved[0](ctx, *nodes, compiler_params=compiler_params, **params)

  def to_triton(jaxpr, *args, **kwargs):
    result = saved[1](jaxpr, *args, **kwargs)
    found.append(
      dict(
        name=pending.get("name") or jaxpr.debug_info.func_name,
        num_warps=pending.get("warps", 4),
        num_stages=pending.get("stages", 3),
        hbm_bytes=pending.get("hbm_bytes", 0),
        ttir=result.module.operation.get_asm(enable_debug_info=False),
      )
    )
    return result

  registration.pallas_call_lowering = lowering_rule
  registration.lowering.lower_jaxpr_to_triton_module = to_triton
  common.kernel_backend = lambda: "gpu"
  if saved[3] is not None:
    rules[triton_core.CompilerParams] = (lowering_rule, saved[3][1])
  try:
    yield found
  finally:
    (
      registration.pallas_call_lowering,
      registration.lowering.lower_jaxpr_to_triton_module,
      common.kernel_backend,
    ) = saved[:3]
    if saved[3] is not None:
      rules[triton_core.CompilerParams] = saved[3]


def _hbm_bytes(avals):
  """Bytes of a pallas_call's operands or results: what the kernel moves through HBM if it
  touches each array once, so that bytes / bandwidth is its time if memory-bound. Approximate:
  a kernel reading part of an operand (or none of it: the gain's reset flags without segments)
  moves less, one re-reading rows from HBM rather than cache more; aliased operands count twice,
  and a kernel inside a scan counts once per lowering, not per iteration."""
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals if hasattr(a, "dtype"))


def triton_modules(fn, *args):
  """The Triton modules of jax.jit(fn)(*args) lowered for CUDA, in lowering order."""
  import jax  # pylint: disable=g-import-not-at-top

  with captured_triton_modules() as found:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return found


# ------------------------------------------------------------------------------- SASS reading


_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BACK_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def sass_loops(sass):
  """(instruction count, innermost loops) of one kernel's nvdisasm text. A loop is a branch back
  to a label at or before it; innermost = containing no other such loop. Each loop:
  {'instructions': n per iteration (straight-line: the body from its label to its back branch),
  'ops': {opcode (no modifiers): count}}. A one-instruction self-branch (the trap nvdisasm
  prints after EXIT) is not a loop."""
  instrs, labels, loops = [], {}, []
  for line in sass.splitlines():
    m = _LABEL.match(line)
    if m:
      labels[m.group(1)] = len(instrs)
      continue
    m = _INSTR.match(line)
    if m:
      instrs.append((m.group(1), line))
  spans = []
  for i, (_, line) in enumerate(instrs):
    m = _BACK_BRANCH.search(line)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
      spans.append((labels[m.group(1)], i))
  for lo, hi in spans:
    if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
      continue
    ops = {}
    for op, _ in instrs[lo : hi + 1]:
      ops[op] = ops.get(op, 0) + 1
    loops.append(dict(instructions=hi - lo + 1, ops=dict(sorted(ops.items()))))
  return len(instrs), loops


def _triton_tool(name):
  import triton  # pylint: disable=g-import-not-at-top

  return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sass(ttir, num_warps, num_stages, capability=90):
  """{'registers', 'local_bytes', 'shared_bytes', 'sass'} of Triton IR text compiled for
  sm_<capability> by the triton package (no GPU needed)."""
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "kernel.ttir")
    with open(src, "w") as f:
      f.write(ttir)
    compiled = triton.compile(
      src,
      target=GPUTarget("cuda", capability, 32),
      options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    sass = subprocess.run(
      [_triton_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
    ).stdout
    usage = subprocess.run(
      [_triton_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
  field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))
  # (shared: what Triton asks for at launch; cuobjdump's SHARED counts static shared memory only)
  return dict(
    registers=field("REG"),
    local_bytes=field("LOCAL"),
    shared_bytes=int(compiled.metadata.shared),
    sass=sass,
  )


# ------------------------------------------------------------------------------------ report


def kernel_report(modules, capability=90, sass_dir=""):
  """One entry per distinct kernel (name + IR): compile_sass's numbers and sass_loops'."""
  rows, seen, hbm = [], {}, {}
  for m in modules:
    key = (m["name"], m["ttir"])
    hbm[key] = hbm.get(key, 0) + m.get("hbm_bytes", 0)  # (every call of the kernel)
    if key in seen:
      continue
    seen[key] = len(rows)
    c = compile_sass(m["ttir"], m["num_warps"], m["num_stages"], capability)
    n, loops = sass_loops(c.pop("sass") if not sass_dir else c["sass"])
    if sass_dir:
      os.makedirs(sass_dir, exist_ok=True)
      same = sum(r["name"] == m["name"] for r in rows)
      with open(os.path.join(sass_dir, f"{m['name']}.{same}.sass"), "w") as f:
        f.write(c.pop("sass"))
    rows.append(
      dict(
        name=m["name"],
        num_warps=m["num_warps"],
        num_stages=m["num_stages"],
        **c,
        instructions=n,
        loops=loops,
      )
    )
  for key, i in seen.items():
    rows[i]["hbm_mb"] = round(hbm[key] / 1e6, 1)
  return rows


HBM_TBS = 3.0  # a bandwidth H100 SXM (3.35 TB/s peak) and H200 (4.8) kernels reach or beat


def _loop_summary(loop):
  ops = loop["ops"]
  keys = ("MUFU", "LDG", "STG", "SHFL", "HMMA", "CALL")
  parts = [f"{k} {ops[k]}" for k in keys if ops.get(k)]
  return f"{loop['instructions']} ({', '.join(parts)})" if parts else str(loop["instructions"])


def format_table(rows):
  """The report as a markdown table; HBM MB: the kernel's operands and results (_hbm_bytes), and
  the time they take at HBM_TBS (the floor of a memory-bound kernel)."""
  head = (
    f"| kernel | warps | stages | regs | local B | smem B | SASS | innermost loops: "
    f"instr/iter | HBM MB | ms at {HBM_TBS} TB/s |"
  )
  lines = [head, "|" + "---|" * 10]
  for r in rows:
    loops = "; ".join(_loop_summary(l) for l in r["loops"]) or "-"
    mb = r.get("hbm_mb")
    floor = "-" if mb is None else f"{mb / (HBM_TBS * 1e6) * 1e3:.3f}"
    lines.append(
      f"| {r['name']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
      f"{r['local_bytes']} | {r['shared_bytes']} | {r['instructions']} | {loops} | "
      f"{'-' if mb is None else mb} | {floor} |"
    )
  return "\n".join(lines)


def format_comparison(rows, base_rows):
  """Registers, SASS instructions and innermost loops' instructions, `base_rows` -> `rows`, per
  kernel (matched by name and rank among the kernels of that name, in lowering order; a kernel
  of one side only shows '-' on the other)."""

  def keyed(rs):
    seen, out = {}, {}
    for r in rs:
      n = seen[r["name"]] = seen.get(r["name"], -1) + 1
      out[r["name"], n] = r
    return out

  base, new = keyed(base_rows), keyed(rows)
  loops = lambda x: (", ".join(str(l["instructions"]) for l in x["loops"]) or "-") if x else "-"
  field = lambda x, key: x[key] if x else "-"
  lines = ["| kernel | regs | SASS | innermost loops: instr/iter |", "|---|---|---|---|"]
  for key in list(new) + [k for k in base if k not in new]:
    b, r = base.get(key), new.get(key)
    arrow = lambda f: f"{field(b, f)} -> {field(r, f)}"
    lines.append(
      f"| {key[0]} | {arrow('registers')} | {arrow('instructions')} | {loops(b)} -> {loops(r)} |"
    )
  return "\n".join(lines)


def _row_fn(row, t, fwd_bwd, kernels):
  """(jitted fn, args) of a mixers-benchmark row or of a layer ('layer:<mixer>', pallas path)."""
  if row.startswith("layer:"):
    from experiments.benchmarks import layers as bl  # pylint: disable=g-import-not-at-top

    shape = dict(
      batch=FLAGS.batch,
      width=FLAGS.heads * FLAGS.dim,
      num_heads=FLAGS.heads,
      head_dim=FLAGS.dim,
      chunk_size=64,
    )
    fwd, fwd_and_bwd, args, ct = bl.layer_fns(
      row.split(":", 1)[1], "pallas", t, shape, kernels=kernels
    )
    return (fwd_and_bwd, args + (ct,)) if fwd_bwd else (fwd, args)
  from experiments.benchmarks.mixers import arg_specs  # pylint: disable=g-import-not-at-top

  shape = arg_specs.Shape(FLAGS.batch, FLAGS.heads, FLAGS.dim)
  return arg_specs.jax_row_fn(row, t, fwd_bwd, kernels, shape)


def main(argv):
  del argv
  if not (FLAGS.row.endswith("_pallas") or FLAGS.row.startswith("layer:")):
    raise app.UsageError(
      f"--row must be a *_pallas mixers-benchmark row or layer:<mixer>, got {FLAGS.row!r}"
    )
  try:
    import triton  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise app.UsageError("kernel_sass needs the triton package (pip install triton)") from e
  kernels = kernel_config.from_flags(FLAGS)
  configs = kernel_config.describe(kernels)
  fn, args = _row_fn(FLAGS.row, FLAGS.seq_len, FLAGS.mode == "fwd_bwd", kernels)
  found = triton_modules(fn, *args)
  rows = kernel_report(found, FLAGS.compute_capability, FLAGS.sass_dir)
  print(
    f"{FLAGS.row} {FLAGS.mode} B={FLAGS.batch} T={FLAGS.seq_len} H={FLAGS.heads} "
    f"K=V={FLAGS.dim} bf16, sm_{FLAGS.compute_capability}"
  )
  print(format_table(rows))
  if FLAGS.baseline_json:
    with open(FLAGS.baseline_json) as f:
      print(f"\nagainst {FLAGS.baseline_json}:")
      print(format_comparison(rows, json.load(f)["kernels"]))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(
        dict(
          row=FLAGS.row,
          mode=FLAGS.mode,
          seq_len=FLAGS.seq_len,
          batch=FLAGS.batch,
          heads=FLAGS.heads,
          dim=FLAGS.dim,
          capability=FLAGS.compute_capability,
          **configs,
          kernels=rows,
        ),
        f,
        indent=1,
      )


if __name__ == "__main__":
  app.run(main, flags_parser=cli.own_flags_parser(FLAGS))
