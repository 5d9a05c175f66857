#!/usr/bin/env bash
# The first run of the Mosaic-TPU kernels on a real TPU (docs/tpu.md). Until this has run, the
# TPU kernels are validated in TPU interpret mode on CPU only. Run from the repo root on a TPU VM
# with jax[tpu] installed:
#   bash experiments/benchmarks/tpu_first_run.sh [section ...]
# sections, in order (default: all):
#   env    jax / libtpu versions and the TPU's kind
#   vmem   the kernels' computed VMEM budgets at B=4 T=16k H=16 K=V=128 bf16 (no device needed)
#   check  exactness first: impl='pallas' (the TPU kernels) against impl='chunked' (XLA), outputs,
#          final states and every gradient, fp32 and bf16, with and without segments, T not a
#          multiple of the blocks; exits non-zero on a failure. It is also the test that Mosaic
#          lowers the kernels at all (interpret mode checks semantics, not lowering/layouts).
#   ops    timings at the real size: chunked vs pallas, fwd and fwd+bwd, B=4 H=16 K=V=128 bf16,
#          T=4096 and 16384 (the GPU tables' size)
#   sweep  fwd+bwd per (gain T block, delta-rule chunk) at T=4096, to pick the TPU defaults
# `auto` stays 'chunked' on TPU (kdn_jax/ops/dispatch.PALLAS_AUTO_PLATFORMS) until `ops` shows
# the kernels winning; only then add "tpu" there, with the table in docs/tpu.md.
# Results land in $RES (default /tmp/kdn_tpu); with $OUT set they are packed into
# $OUT/results.tgz.
set -u
RES=${RES:-/tmp/kdn_tpu}
mkdir -p "$RES"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$RES" . ; }
trap pack EXIT
trap 'exit 143' TERM
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kdn_jax_cache}
sections=${*:-env vmem check ops sweep}
status=0

for s in $sections; do case $s in
env)
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__);
print(jax.devices()); print('kind', jax.devices()[0].device_kind)" 2>&1 | tee "$RES/env.txt"
  pip list 2>/dev/null | grep -i -E '^(jax|libtpu)' | tee -a "$RES/env.txt" ;;
vmem)
  python3 -m pallas_kernels.tpu_vmem 2>&1 | tee "$RES/vmem.md" ;;
check)
  timeout ${CHECK_LIMIT:-900} python3 -m experiments.benchmarks.tpu_check --mode=check --seq_lens=1000,4096 \
    --batch=2 --heads=4 --dim=128 --dtypes=float32,bfloat16 --out="$RES/check.json" \
    2>&1 | tee "$RES/check.txt"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    echo "check FAILED (rc $rc): do not time the kernels; see $RES/check.txt" | tee -a "$RES/check.txt"
    status=1; break
  fi ;;
ops)
  timeout ${OPS_LIMIT:-900} python3 -m experiments.benchmarks.ops --seq_lens=4096,16384 \
    --impls=chunked,pallas --ops=diag_kdn,iso_kdn --batch=4 --heads=16 --key_dim=128 \
    --value_dim=128 --dtype=bfloat16 --repeats=10 --out="$RES/bench_ops_tpu.json" \
    2>&1 | tee "$RES/bench_ops_tpu.txt" ;;
sweep)
  timeout ${SWEEP_LIMIT:-1200} python3 -m experiments.benchmarks.tpu_check --mode=sweep --seq_lens=4096 \
    --batch=4 --heads=16 --dim=128 --dtypes=bfloat16 --gain_blocks=64,128,256 --chunks=16,32,64 \
    --repeats=10 --out="$RES/sweep.json" 2>&1 | tee "$RES/sweep.txt" ;;
*) echo "unknown section $s"; status=2 ;;
esac; done
exit $status
