#!/usr/bin/env bash
# CPU-B (64 requests, 16-512 in, 16-256 out) alternated between an earlier commit and the
# working tree, ROUNDS times each, results to benchmarks/results/cpu-b-wing-{before,after}-N-TAG.json.
# usage: benchmarks/cpu_b_wing_ab.sh [BASE_COMMIT (84f72d7: before the CPU wing)] [TAG] [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
base=${1:-84f72d7}; tag=${2:-local}; rounds=${3:-2}
tree=$(mktemp -d /tmp/kvflow-base-XXXX)
git archive "$base" | tar -x -C "$tree"
args=(bench throughput --backend kvflow --num-prompts 64 --min-input-len 16 --max-input-len 512
      --min-output-len 16 --max-output-len 256 --seed 0)
head=$(git rev-parse HEAD)
for i in $(seq 1 "$rounds"); do
  for v in before after; do
    out=$root/benchmarks/results/cpu-b-wing-$v-$i-$tag.json
    if [ $v = before ]; then
      (cd "$tree" && KVFLOW_GIT_COMMIT=$base PYTHONPATH=$tree "$root/.venv/bin/python" -m kvflow.cli \
        "${args[@]}" --save-result "$out" 2>&1 | grep "Throughput" | tail -1)
    else
      KVFLOW_GIT_COMMIT=$head .venv/bin/python -m kvflow.cli "${args[@]}" --save-result "$out" \
        2>&1 | grep "Throughput" | tail -1
    fi
    echo "$v $i load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
rm -rf "$tree"
