#!/usr/bin/env bash
# Pipeline parallelism on CPU (gloo, 2 stages): two batches in flight (one per stage,
# the default) against one at a time, interleaved twice in one invocation so the
# ratio holds on a shared machine; TP 1 for reference. Results in benchmarks/results/.
# On a 2-core machine this shows correctness and overhead, not speedup.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
common=(--model smollm2-135m --load-format dummy --device cpu --quantization none
        --max-model-len 256 --num-prompts 32 --input-len 32 --output-len 32)
for run in 1 2; do
  $PY -m kvflow.cli bench throughput "${common[@]}" -pp 2 --pipeline-in-flight 2 \
      --save-result "$OUT/cpu-pp2-inflight2-smollm2-dummy-run$run.json"
  $PY -m kvflow.cli bench throughput "${common[@]}" -pp 2 --pipeline-in-flight 1 \
      --save-result "$OUT/cpu-pp2-inflight1-smollm2-dummy-run$run.json"
done
$PY -m kvflow.cli bench throughput "${common[@]}" \
    --save-result "$OUT/cpu-tp1-smollm2-dummy-throughput.json"
