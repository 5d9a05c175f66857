#!/usr/bin/env bash
# One study command on the device machine (the device tool's `run`), its results brought back.
#   bash experiments/studies/on_device.sh <results folder> python3 -m experiments.studies.passkey \
#       --results=<results folder> --deadline_s=<s> ...
# Installs the carried wheels in .whl/ (the machine reaches no registry: WORKSPACE.md), runs the
# command with its output in $OUT/study.log, then packs the results folder (the JSON the renderers
# read) and the arms' logs into $OUT/results.tgz. Run folders (checkpoints) stay on the machine: a
# second command on the still-warm machine resumes them; a fresh machine starts them again.
set -u
res=$1; shift
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
"$@" > "$OUT/study.log" 2>&1
rc=$?
echo "study exit $rc after $(( $(date +%s) - t0 )) s"
grep -E "^study|Error|Traceback" "$OUT/study.log" | tail -30
work=$(dirname "$(dirname "$res")")   # <workdir>/results/<preset>: the arms' logs sit in <workdir>
tar czf "$OUT/results.tgz" -C / "${res#/}" $(cd / && ls "${work#/}"/*.log 2>/dev/null) 2>/dev/null
ls -la "$OUT"
exit $rc
