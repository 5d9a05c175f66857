#!/usr/bin/env bash
# The GPU measurements reported in docs/. Run from the repo root on a GPU host:
#   bash experiments/benchmarks/gpu_measurements.sh [section ...]
# Sections:
#   check        GPU correctness: every Pallas op against its reference (fp32, bf16, segments) at
#                K=128, K=16 and K=256, and the layers' fused glue kernels (check_fusion)
#   ops          reference vs chunked XLA paths
#   stages       the Pallas stage split, with a kernel config sweep (SWEEP)
#   docs         the same for the packed-documents path
#   mixers       the op table against flash-linear-attention
#   layers       whole layers against fla's KDA layer
#   train        125M LM training throughput on 1 GPU (and 2 where there are 2)
#   forward      forward configs at 16k with the stage split and at 4k
#   wide         K = V = 256: a sweep of the wide-K tiles, the GPU check of the winner, then ours
#                against fla's chunk_kda (WIDE_ROWS, WIDE_LENS)
#   ncu          Nsight Compute on the pair and gain kernels, ours and fla's
#   decode       the fused decode step against fla's fused_recurrent_kda (B = 1, 16, 64, 256), its
#                block_v x num_warps sweep, 125M generation with the XLA and the fused step, and
#                kernels per step / per token from profiler traces (DECODE_TRACES)
#   performance  the records behind docs/performance.md
#   sweep_memory memory per member of the MQAR Zoology sweep's step (compiled and one step's peak),
#                one process per (width, mixer); SWEEP_MIXERS, SWEEP_WIDTHS, SWEEP_BATCH
# Default: check ops stages docs mixers layers train.
# Kernel config sweep (stages): SWEEP='default,num_warps_intra=2/block_v=32' (DeltaRuleConfig fields).
# Extra train flags: TRAIN_EXTRA='--config.model.scan_layers=True --config.model.impl=pallas';
# kernel options: TRAIN_EXTRA='--config.kernels.delta_rule=num_stages=2'.
# Results land in $RES (default /tmp/kdn_gpu); with $OUT set (the device tool) they are also packed
# into $OUT/results.tgz. Each section has its own time limit.
set -u
RES=${RES:-/tmp/kdn_gpu}
mkdir -p "$RES"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$RES" . ; }
trap pack EXIT
trap 'exit 143' TERM
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v -E '^[WI][0-9]{4} |libtpu|tpu backend'; }
sections=${*:-check ops stages docs mixers layers train}
# Identical programs (a sweep's winner and the same row later) compile once per run.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kdn_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
MIXER_LENS=${MIXER_LENS:-4096,16384,2048,8192,32768}
TRAIN_STEPS=${TRAIN_STEPS:-30}

# One mixers-benchmark sweep line (limit, flags...), its ranking lines to $RES/$SWEEP_LOG (the
# stage splits stay in the JSON), packed after.
sweep_line() { timeout "$1" python3 -m experiments.benchmarks.mixers --pallas_lens= --reps=${REPS:-20} \
    --sweep_combine=false --rows= --check=false "${@:2}" 2>&1 | quiet | grep '"sweep"' \
    | sed 's/, "stages".*//' | tee -a "$RES/$SWEEP_LOG"; pack; }
# GPU checks, one process each: dim:delta-rule spec[:gain spec],... (a one-spec sweep makes that
# spec the config the check runs; a spec whose timing fails leaves the default in place, which
# the log line "sweep ... failed" says). To $RES/$SWEEP_LOG: the largest error per op, failures
# and a non-zero exit (124: the limit).
gpu_checks() {
  for c in $(echo "$1" | tr , ' '); do
    set -- ${c//:/ }   # dim:delta-rule spec[:gain spec]
    name=k$1_${2//\//_}${3:+_${3//\//_}}   # (specs join fields with '/')
    timeout ${CHECK_LIMIT:-120} python3 -m experiments.benchmarks.mixers --out="$RES/check_$name" \
      --check_only --check_dim=$1 --sweep_len=2048 --sweep_combine=false --sweep=$2 \
      ${3:+--gain_sweep=$3} > "$RES/check_$name.log" 2>&1
    rc=$?
    quiet < "$RES/check_$name.log" | grep -E '^check |FAILED' > "$RES/check_$name.txt"
    { [ $rc -ne 0 ] && echo "exit $rc"
      grep -o 'sweep .* failed.*' "$RES/check_$name.log" | cut -c1-300
      for op in delta_rule_float32 delta_rule_bfloat16 gain_float32 gain_bfloat16; do   # largest
        grep "^check .*$op" "$RES/check_$name.txt" | grep -v nan | sort -g -k3 | tail -1
      done
      grep -E "nan|FAILED" "$RES/check_$name.txt"
    } | sed "s|^|$name: |" | tee -a "$RES/$SWEEP_LOG"
    pack
  done; }

nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$RES/gpus.txt"
ngpu=$(nvidia-smi -L | wc -l)

for s in $sections; do case $s in
check)
  # The op check at the benchmark's defaults, the GPU checks at K=128, K=16 and K=256
  # (CHECK_CASES, each up to CHECK_LIMIT: a cold compile cache needs ~110 s at K=128), then the
  # fused glue kernels. About 700 s at most; CHECK_PARTS="ops cases glue" picks parts.
  SWEEP_LOG=check.txt
  for part in ${CHECK_PARTS:-ops cases glue}; do case $part in
  ops)
    timeout ${CHECK_LIMIT:-150} python3 -m experiments.benchmarks.mixers --out="$RES/check" \
      --check_only 2>&1 | quiet | tail -30 | tee -a "$RES/$SWEEP_LOG"; pack ;;
  cases)
    CHECK_LIMIT=${CHECK_LIMIT:-120} gpu_checks "${CHECK_CASES:-128:default,16:default,256:default}" ;;
  glue)
    timeout ${GLUE_LIMIT:-240} python3 -m experiments.benchmarks.check_fusion \
      --out="$RES/check_fusion.json" 2>&1 | quiet | tail -15 | tee "$RES/check_fusion.txt"; pack ;;
  *) echo "unknown check part $part" ;;
  esac; done ;;
ops)
  timeout 170 python3 -m experiments.benchmarks.ops --seq_lens=1024,4096,16384 \
    --impls=reference,chunked --ops=diag_kdn,iso_kdn --repeats=5 \
    --out="$RES/bench_ops_gpu.json" 2>&1 | quiet | tee "$RES/bench_ops_gpu.txt" ;;
stages)
  # Sweep (each spec timed fwd+bwd at 4096, with its stage split), keep the fastest, check it on
  # the GPU, then time STAGE_ROWS at STAGE_LENS with it (one process: the winner carries over).
  timeout ${STAGES_LIMIT:-540} python3 -m experiments.benchmarks.mixers --out="$RES/stages" \
    --seq_lens=${STAGE_LENS:-4096} --pallas_lens= --reps=${REPS:-10} --check=${STAGES_CHECK:-true} \
    --time_budget_s=${STAGES_BUDGET:-420} --stages --stages_docs --sweep_stages \
    --sweep=${SWEEP-default,bf16_states=0,num_warps_intra=4} \
    --rows=${STAGE_ROWS:-diag_kdn_pallas,iso_kdn_pallas,fla_chunk_kda} \
    2>&1 | quiet | tail -60 | tee "$RES/stages.txt" ;;
docs)
  # The packed-documents path (segment_ids): sweep on diag_kdn_seg_pallas with the stage split
  # under documents, then the GPU check of the winner (segments included) and its rows. The
  # default sweep: the partials kernel's warps (the default 4 against 8).
  timeout ${DOCS_LIMIT:-400} python3 -m experiments.benchmarks.mixers --out="$RES/docs" \
    --seq_lens=4096 --pallas_lens= --reps=${REPS:-10} --check=true --time_budget_s=${DOCS_BUDGET:-300} \
    --sweep_row=diag_kdn_seg_pallas --sweep_stages \
    --sweep=${DOCS_SWEEP-default,num_warps_parallel=8} \
    --rows=diag_kdn_seg_pallas,iso_kdn_seg_pallas,diag_kdn_pallas \
    2>&1 | quiet | tail -40 | tee "$RES/docs.txt" ;;
mixers)
  # The full mixer table (all rows, 2k-32k): ~500 s on one H200.
  timeout ${MIXERS_LIMIT:-570} python3 -m experiments.benchmarks.mixers --out="$RES/mixers" \
    --seq_lens=$MIXER_LENS --reps=${REPS:-30} --check=false --time_budget_s=${MIXERS_BUDGET:-490} \
    --pallas_lens=${PALLAS_LENS:-} --sweep=${SWEEP-} \
    --chunked_max_len=${CHUNKED_MAX_LEN:-8192} \
    --rows=${MIXER_ROWS:-diag_kdn_pallas,iso_kdn_pallas,fla_chunk_kda,fla_chunk_gdn,kda_pallas,gdn_pallas,diag_kdn_chunked,iso_kdn_chunked} \
    2>&1 | quiet | tail -40 | tee "$RES/bench_mixers_gpu.txt" ;;
layers)
  # fla's KDA layer autotunes on its first call (> 190 s): T=16384 first, and a limit that lets
  # it finish (235 s cuts it off).
  timeout ${LAYERS_LIMIT:-430} python3 -m experiments.benchmarks.layers --out="$RES/layers" \
    --seq_lens=${LAYER_LENS:-16384,4096} \
    --time_budget_s=${LAYERS_BUDGET:-370} --impls=${LAYER_IMPLS:-pallas,chunked} \
    --rows=${LAYER_ROWS:-kdn_diag,kdn_iso,kda,gated_deltanet,fla_kda_layer} 2>&1 | quiet | tail -30 | tee "$RES/bench_layers_gpu.txt" ;;
train)
  python3 -m experiments.data.make_token_file /tmp/kdn_tokens.npy --num_docs=20000 >/dev/null
  for n in $(seq 1 "$ngpu"); do
    [ "$n" -gt 2 ] && break
    JAX_LOG_COMPILES=1 CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout ${TRAIN_LIMIT:-200} python3 -m experiments.train \
      --config=configs/lm_125m.py:default --workdir="/tmp/kdn_train_${n}gpu" \
      --config.data.train_path=/tmp/kdn_tokens.npy --config.data.eval_path=/tmp/kdn_tokens.npy \
      --config.data.global_batch_size=$((8 * n)) --config.mesh.data=-1 --config.mesh.fsdp=1 \
      --config.train.num_steps=$TRAIN_STEPS --config.train.log_every=5 --config.train.eval_every=0 \
      --config.train.eval_batches=1 --config.data.eval_batch_size=$((8 * n)) \
      --config.data.num_eval_examples=$((8 * n)) --config.checkpoint.enabled=false ${TRAIN_EXTRA:-} \
      2>&1 | tee "$RES/train_${n}gpu.txt" | quiet | tail -12
    grep -c "Compiling" "$RES/train_${n}gpu.txt" | sed 's/^/compiles logged: /'
    cp "/tmp/kdn_train_${n}gpu/summary.json" "$RES/train_${n}gpu_summary.json" 2>/dev/null
  done ;;
forward)
  # The forward at 16k with its stage split, then at 4k: FORWARD_SWEEP (default: the shipped
  # config alone; DeltaRuleConfig specs to compare); FORWARD_LIMIT / FORWARD_4K_LIMIT: their limits.
  # Then the GPU checks CHECK_CASES=dim:spec[:gain spec],... (default: the default at K=128 and
  # 16; each up to CHECK_LIMIT, 120 s: a cold compile cache needs more than 110 s at K=128).
  # About 450 s at most (FORWARD_DOCS=1: the forward with documents, +50 s). Each
  # line has its own limit, and results.tgz is packed after each.
  SWEEP_LOG=forward.txt
  SPECS=${FORWARD_SWEEP:-default}
  sweep_line ${FORWARD_LIMIT:-220} --out="$RES/forward_16384" --seq_lens=16384 --sweep_len=16384 \
    --sweep_fwd_only --sweep_stages --sweep=$SPECS
  sweep_line ${FORWARD_4K_LIMIT:-110} --out="$RES/forward_4096" --seq_lens=4096 --sweep_len=4096 \
    --sweep_fwd_only --sweep=$SPECS
  [ "${FORWARD_DOCS:-0}" = 1 ] && sweep_line 50 --out="$RES/forward_docs" --seq_lens=16384 \
    --sweep_len=16384 --sweep_fwd_only --sweep_row=diag_kdn_seg_pallas --sweep=default
  gpu_checks "${CHECK_CASES:-128:default,16:default}" ;;
wide)
  # K = V = 256 (key tiles and the wide V blocks: DeltaRuleConfig.block_k, wide_block_v*): the
  # sweep (WIDE_SWEEP, fwd+bwd on kda_pallas at 4096; a spec that does not compile is reported
  # failed and skipped), the GPU check of the fastest, then WIDE_ROWS at WIDE_LENS with it.
  timeout ${WIDE_LIMIT:-570} python3 -m experiments.benchmarks.mixers --out="$RES/wide" \
    --dim=256 --check_dim=256 --check=true --seq_lens=${WIDE_LENS:-4096,16384} --reps=${REPS:-20} \
    --time_budget_s=${WIDE_BUDGET:-480} --sweep_row=kda_pallas --sweep_combine=false \
    --sweep=${WIDE_SWEEP-default,wide_block_v=64,wide_block_v_parallel=32,block_k=64} \
    --rows=${WIDE_ROWS:-kda_pallas,fla_chunk_kda,diag_kdn_pallas,iso_kdn_pallas,kda_chunked} \
    2>&1 | quiet | tail -40 | tee "$RES/bench_wide_gpu.txt" ;;
ncu)
  # Nsight Compute on one forward per row (experiments/benchmarks/kernel_dev/profile_kernels.py): the kernels matching
  # NCU_KERNELS (default: our token-parallel pair kernel, fla's token-parallel intra kernel of
  # the same structure, and our gain kernels) in NCU_ROWS
  # (default diag_kdn_pallas iso_kdn_pallas fla_chunk_kda) at T=NCU_LEN (4096); full reports in
  # $RES/ncu_<row>.txt, their headline lines in ncu.txt. About 400 s at most (fla autotunes).
  SWEEP_LOG=ncu.txt
  for row in ${NCU_ROWS:-diag_kdn_pallas iso_kdn_pallas fla_chunk_kda}; do
    timeout ${NCU_LIMIT:-150} ncu --clock-control none --profile-from-start off \
      --kernel-name "regex:${NCU_KERNELS:-pair_token_loop|intra_token_parallel|kdn_gain}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section LaunchStats --section Occupancy \
      python3 -m experiments.benchmarks.kernel_dev.profile_kernels --row=$row --seq_len=${NCU_LEN:-4096} --mode=fwd \
      > "$RES/ncu_$row.txt" 2>&1
    grep -E "^  [a-z_]+ \(|Duration|L1/TEX Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occ|Issued Warp" \
      "$RES/ncu_$row.txt" | sed "s|^|ncu $row: |" | tee -a "$RES/$SWEEP_LOG"
    pack
  done ;;
decode)
  # About 6 min (DECODE_BUDGET; the cells in order of importance: each row at its tuned config,
  # generation, then the sweep). Traces stay in DECODE_TRACES (not packed: large); their kernel
  # counts are in decode.json.
  timeout ${DECODE_LIMIT:-470} python3 -m experiments.benchmarks.decode --out="$RES/decode" \
    --rows=diag_kdn_pallas,iso_kdn_pallas,kda_pallas,diag_kdn_xla,fla_fused_recurrent_kda \
    --block_v=8,16,32 --num_warps=1,2,4 --profile_dir="${DECODE_TRACES:-/tmp/kdn_decode_traces}" \
    --time_budget_s=${DECODE_BUDGET:-400} 2>&1 | quiet | grep -v "^{" | tail -20
  cat "$RES/decode.md"; pack ;;
performance)
  # The numbers behind docs/performance.md, at the defaults: the KDN ops against fla's chunk_kda
  # and the KDN layers against fla's KimiDeltaAttention (each benchmark one process, fla in it),
  # and 125M training. PERF_PARTS picks the parts (default "mixers layers"; mixers ~250 s, layers
  # ~430 s with fla's first-call autotune, train ~200 s, decode ~200 s, guard (the non-finite
  # guard's cost at 4k and 16k) ~200 s: one call each within a 600 s limit).
  # Each part writes $OUT/performance/<part>.json ({"meta", "result"}); copy them to
  # docs/performance/<h100|h200>/ and run python -m experiments.benchmarks.render_performance.
  PERF=${OUT:-$RES}/performance; mkdir -p "$PERF"
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  record() { python3 -m experiments.benchmarks.render_performance --wrap="$1" --command="$2" \
    --device="$gpu" --out="$PERF/$3.json"; }
  for part in ${PERF_PARTS:-mixers layers}; do case $part in
  mixers)
    cmd="python3 -m experiments.benchmarks.mixers --seq_lens=16384,4096 --reps=20 --check=false
      --time_budget_s=${PERF_MIXERS_BUDGET:-400} --rows=diag_kdn_pallas,iso_kdn_pallas,fla_chunk_kda"
    rm -rf "$RES/perf_mixers"
    timeout ${PERF_MIXERS_LIMIT:-480} $cmd --out="$RES/perf_mixers" 2>&1 | quiet | tail -20
    record "$RES/perf_mixers/results.json" "$(echo $cmd)" mixers ;;
  layers)
    cmd="python3 -m experiments.benchmarks.layers --seq_lens=16384,4096 --impls=pallas
      --time_budget_s=${PERF_LAYERS_BUDGET:-430} --rows=kdn_diag,kdn_iso,fla_kda_layer"
    rm -f "$RES/perf_layers.json"
    timeout ${PERF_LAYERS_LIMIT:-500} $cmd --out="$RES/perf_layers" 2>&1 | quiet | tail -20
    record "$RES/perf_layers.json" "$(echo $cmd)" layers ;;
  train)
    rm -f "$RES/train_1gpu_summary.json"
    TRAIN_LIMIT=${TRAIN_LIMIT:-230} bash "$0" train
    record "$RES/train_1gpu_summary.json" \
      "TRAIN_LIMIT=${TRAIN_LIMIT:-230} bash experiments/benchmarks/gpu_measurements.sh train" train_125m ;;
  decode)
    cmd="python3 -m experiments.benchmarks.decode --time_budget_s=${PERF_DECODE_BUDGET:-200} --reps=10"
    rm -f "$RES/perf_decode.json"
    timeout ${PERF_DECODE_LIMIT:-330} $cmd --out="$RES/perf_decode" 2>&1 | quiet | tail -20
    record "$RES/perf_decode.json" "$(echo $cmd)" decode ;;
  guard)
    cmd="python3 -m experiments.benchmarks.nonfinite_guard --impl=pallas --b=4 --h=16 --d=128
      --t=4096,16384"
    rm -f "$RES/perf_guard.json"
    timeout ${PERF_GUARD_LIMIT:-240} $cmd --out="$RES/perf_guard.json" 2>&1 | quiet | tail -20
    record "$RES/perf_guard.json" "$(echo $cmd)" guard ;;
  *) echo "unknown performance part $part" ;;
  esac; done ;;
sweep_memory)
  # One process per (width, mixer): the device's peak is a running maximum over the process.
  # About 60 s a row; JSON lines in $RES/sweep_memory.jsonl, the summary lines in sweep_memory.txt.
  for w in $(echo "${SWEEP_WIDTHS:-64,128}" | tr , ' '); do
    for m in $(echo "${SWEEP_MIXERS:-kdn_diag,kdn_iso,kda,gated_deltanet}" | tr , ' '); do
      timeout ${SWEEP_MEMORY_LIMIT:-240} python3 -m experiments.benchmarks.sweep_memory \
        --widths=$w --mixers=$m --batch=${SWEEP_BATCH:-128} --run_step --out="$RES/sweep_memory.jsonl" 2>&1 \
        | quiet | grep -E '^#|Error' | tee -a "$RES/sweep_memory.txt"
      pack
    done
  done ;;
*) echo "unknown section $s" ;;
esac; done
