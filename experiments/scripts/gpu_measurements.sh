#!/usr/bin/env bash
# The GPU measurements reported in docs/: the ops benchmark (reference vs
# chunked), the mixer benchmark against flash-linear-attention, and 125M LM
# training throughput on 1 vs 2 GPUs (data parallel). Run from the repo root
# on a GPU host; results land in $OUT (default /tmp/kdn_gpu).
set -u
OUT=${OUT:-/tmp/kdn_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v -E '^[WI][0-9]{4} |libtpu|tpu backend'; }

nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"

timeout 170 python3 -m experiments.benchmark_ops --seq_lens=1024,4096,16384 \
  --impls=reference,chunked --ops=diag_kdn,iso_kdn --repeats=5 \
  --out="$OUT/bench_ops_gpu.json" 2>&1 | quiet | tee "$OUT/bench_ops_gpu.txt"

timeout 170 python3 -m experiments.benchmark_mixers --out="$OUT/mixers" \
  --seq_lens=4096,16384 --reps=10 --check=false --time_budget_s=140 \
  --rows=diag_kdn_chunked,iso_kdn_chunked,kda_chunked,gdn_chunked,fla_chunk_kda,fla_chunk_gdn,diag_kdn_pallas \
  2>&1 | quiet | tail -40 | tee "$OUT/bench_mixers_gpu.txt"

python3 -m experiments.data.make_token_file /tmp/kdn_tokens.npy --num_docs=20000
for n in 1 2; do
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 140 python3 -m experiments.train \
    --config=configs/lm_125m.py:default --workdir="/tmp/kdn_train_${n}gpu" \
    --config.data.train_path=/tmp/kdn_tokens.npy --config.data.eval_path=/tmp/kdn_tokens.npy \
    --config.data.global_batch_size=$((8 * n)) --config.mesh.data=-1 --config.mesh.fsdp=1 \
    --config.train.num_steps=40 --config.train.log_every=10 --config.train.eval_every=1000000 \
    --config.train.eval_batches=1 --config.data.eval_batch_size=$((8 * n)) \
    --config.data.num_eval_examples=$((8 * n)) --config.checkpoint.enabled=false \
    2>&1 | quiet | tail -8 | tee "$OUT/train_${n}gpu.txt"
  cp "/tmp/kdn_train_${n}gpu/metrics.jsonl" "$OUT/train_${n}gpu.jsonl" 2>/dev/null
done
