#!/usr/bin/env bash
# Latency-target batching on CPU: kvflow serve with and without --target-tpot-ms, each at
# an arrival rate below and above capacity, the same workload (kvflow bench serve).
# Usage: scripts/bench_latency_target.sh [TARGET_MS] [LOW_RATE] [HIGH_RATE] [NUM_PROMPTS] [TTFT_MS]
# (the third configuration adds --target-ttft-ms TTFT_MS; goodput counts TTFT <= TTFT_MS)
# Run under flock /tmp/kvflow-bench.lock on a shared machine. Results:
# benchmarks/results/cpu-latency-target-{off,on,on-ttft}-rate-{LOW,HIGH}.json
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-80}
LOW=${2:-1}
HIGH=${3:-6}
N=${4:-40}
TTFT=${5:-3000}
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8031}
OUT=benchmarks/results
WORKLOAD=(--num-prompts "$N" --input-len 128 --output-len 32 --range-ratio 0.5
          --goodput "tpot:$TARGET" "ttft:$TTFT")
SERVER=(--max-model-len 1024 --kv-cache-memory 512MiB --stats-log-interval 0)

run_config() {  # $1: off|on, then server flags
  local tag=$1; shift
  local log; log=$(mktemp /tmp/kvflow-latency-target-XXXX.log)
  "$PY" -m kvflow.cli serve --port "$PORT" "${SERVER[@]}" "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
  done
  local seed=0
  for rate in "$LOW" "$HIGH"; do
    seed=$((seed + 1))  # other prompts at the second rate: no prefix-cache hits from the first
    "$PY" -m kvflow.cli bench serve --base-url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" \
      --request-rate "$rate" --seed "$seed" \
      --metadata "server=kvflow serve ${SERVER[*]} $*" --metadata "target_tpot_ms=$TARGET" --metadata "target_ttft_ms=$TTFT" \
      --save-result "$OUT/cpu-latency-target-$tag-rate-$rate.json"
  done
  grep -i "latency target" "$log" || true
  kill -INT "$pid"; wait "$pid" || true
}

run_config off
run_config on --target-tpot-ms "$TARGET"
run_config on-ttft --target-tpot-ms "$TARGET" --target-ttft-ms "$TTFT"
