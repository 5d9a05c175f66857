#!/usr/bin/env bash
# The second paper's protocol at small scale (docs/RESULTS.md, "Length generalisation"): pretrain each
# mixer at T=512 from the zero state, post-train it with every initial-state intervention (a fresh
# optimizer, train.init_from), then evaluate every checkpoint: position-wise perplexity to MAX_LEN,
# Effective Remembrance, beta_eff, and (pretrained models) S-NIAH. Re-running skips finished runs and
# evaluations. Run from the repo root, on a GPU for the default presets:
#   MIXERS="kdn_diag kda gla" bash experiments/studies/length_generalisation.sh
#   PRE=smoke POST=smoke PRE_EXTRA=--config.train.num_steps=20 MAX_LEN=1024 ... (a CPU dry run)
# With $OUT set (the device tool) the small outputs (configs, metrics, summaries, eval JSON/PNG) are packed
# into $OUT/lengen_<mixers>.tgz.
set -u
MIXERS=${MIXERS:-kdn_diag kda gla}
STRATEGIES=${STRATEGIES:-zero random_noise fitted_noise state_passing tbtt}
PRE=${PRE:-default}
POST=${POST:-post}
CORPUS=${CORPUS:-/tmp/kdn_corpus}
RUNS=${RUNS:-workdirs/lengen}
MAX_LEN=${MAX_LEN:-16384}
PAR=${PAR:-6}                          # processes at a time (they share the accelerator)
TRAIN_LIMIT=${TRAIN_LIMIT:-420}
EVAL_LIMIT=${EVAL_LIMIT:-300}
PRE_EXTRA=${PRE_EXTRA:-}
POST_EXTRA=${POST_EXTRA:-}
EVAL_EXTRA=${EVAL_EXTRA:-}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kdn_jax_cache}
mkdir -p "$RUNS"
tag=$(echo $MIXERS | tr ' ' '_')
pack() {
  [ -n "${OUT:-}" ] || return 0
  (cd "$RUNS" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.png' -o -name '*.log' \) \
     -not -path '*/checkpoints/*' -print0 | tar czf "$OUT/lengen_$tag.tgz" --null -T -)
}
trap pack EXIT
trap 'exit 143' TERM

done_run() { grep -q '"status": "completed"' "$1/summary.json" 2>/dev/null; }
train() {  # workdir config [flags...]
  local wd=$1; shift
  done_run "$wd" && { echo "skip $wd (completed)"; return 0; }
  mkdir -p "$wd"
  timeout "$TRAIN_LIMIT" python3 -m experiments.train --workdir="$wd" "$@" \
    --config.data.corpus_dir="$CORPUS" > "$wd/train.log" 2>&1
  echo "$wd: train rc=$? $(grep -E '^final eval' "$wd/train.log" | tail -1)"
}
evaluate() {  # workdir suites
  [ -f "$1/eval/summary.json" ] && { echo "skip eval $1"; return 0; }
  timeout "$EVAL_LIMIT" python3 -m experiments.evaluate --workdir="$1" --suite="$2" --max_len="$MAX_LEN" \
    $EVAL_EXTRA > "$1/eval.log" 2>&1
  echo "$1: eval rc=$? | $(grep -E '^position-wise|^EffRem|^beta_eff' "$1/eval.log" | tr '\n' ' ')"
}
export -f train evaluate done_run
export CORPUS RUNS MAX_LEN TRAIN_LIMIT EVAL_LIMIT EVAL_EXTRA

t0=$(date +%s)
echo "== pretrain ($PRE): $MIXERS"
for m in $MIXERS; do
  train "$RUNS/$m/pretrain" --config="configs/lm_corpus.py:$PRE,$m" $PRE_EXTRA &
done
wait
echo "== post-train ($POST): $STRATEGIES  [$(( $(date +%s) - t0 )) s]"
for m in $MIXERS; do for s in $STRATEGIES; do
  echo "$RUNS/$m/$s --config=configs/lm_corpus.py:$POST,$m,$s --config.train.init_from=$RUNS/$m/pretrain $POST_EXTRA"
done; done | xargs -d '\n' -P "$PAR" -I{} bash -c 'train {}'
echo "== evaluate  [$(( $(date +%s) - t0 )) s]"
{
  for m in $MIXERS; do
    echo "$RUNS/$m/pretrain ppl,position_ppl,effrem,beta_eff,retrieval"
    for s in $STRATEGIES; do echo "$RUNS/$m/$s ppl,position_ppl,effrem,beta_eff"; done
  done
} | xargs -d '\n' -P "$PAR" -I{} bash -c 'evaluate {}'
echo "== done [$(( $(date +%s) - t0 )) s]"
