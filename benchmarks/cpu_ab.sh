#!/usr/bin/env bash
# The acceptance check of a behaviour-preserving change on CPU: CPU-A (batch 1, a chat
# prompt, 128 out, 3 iterations) and CPU-B (64 requests, 16-512 in, 16-256 out, seed 0)
# alternated between a checkout of an earlier commit and this checkout, ROUNDS times
# each, on the embedded model. Each side runs with PYTHONPATH at its own tree (the package
# may be installed editable from a third checkout) and prints which kvflow it imported.
# Results: benchmarks/results/cpu-{a,b}-TAG-{before,after}-runN.json.
# usage: benchmarks/cpu_ab.sh BEFORE_TREE TAG [ROUNDS (2)]
#   BEFORE_TREE: a checkout of the earlier commit, e.g. `git worktree add /tmp/before SHA`
#   (give it a .venv link too); warm both sides once first (the C++ step's first build in
#   each tree takes ~40 s, and would land in the first timed run).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
before=$(cd "$1" && pwd); tag=$2; rounds=${3:-2}
a_args=(bench latency --backend kvflow --chat-prompt 'Write a short poem about autumn leaves.'
        --output-len 128 --num-iters 3)
b_args=(bench throughput --backend kvflow --num-prompts 64 --min-input-len 16 --max-input-len 512
        --min-output-len 16 --max-output-len 256 --seed 0)
run() {  # side tree workload out args...
  local side=$1 tree=$2 w=$3 out=$4; shift 4
  (cd "$tree" && export PYTHONPATH=$tree KVFLOW_NO_PROGRESS=1 &&
   "$root/.venv/bin/python" -c "import kvflow; print('$side imports', kvflow.__file__)" &&
   "$root/.venv/bin/python" -m kvflow.cli "$@" --save-result "$out" 2>&1 |
     tail -4)
  echo "$side $w done, load $(cut -d' ' -f1-3 /proc/loadavg)"
}
for i in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=$root; [ "$side" = before ] && tree=$before
    run "$side" "$tree" A "$root/benchmarks/results/cpu-a-$tag-$side-run$i.json" "${a_args[@]}"
    run "$side" "$tree" B "$root/benchmarks/results/cpu-b-$tag-$side-run$i.json" "${b_args[@]}"
  done
done
