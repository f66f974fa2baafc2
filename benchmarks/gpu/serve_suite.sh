#!/usr/bin/env bash
# GPU-S on the device machine: `kvflow serve` Llama-3.1-8B (dummy bf16) and
# `kvflow bench serve` at several request rates. Results under $OUT.
#   RATES="4:300 16:1000 inf:1000"  (rate:num_prompts pairs)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # the server's dependencies, built by build_wheelhouse.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
[ -f .git-commit ] && export KVFLOW_GIT_COMMIT=$(cat .git-commit)
SERVE="python3 -m kvflow.cli serve llama-3.1-8b --load-format dummy --max-model-len 4096 --port 8000"
$SERVE > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 180); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 1
done
echo "server ready after ${i}s"
seed=0
for pair in ${RATES:-4:300 16:1000 inf:1000}; do
  rate=${pair%%:*}; n=${pair##*:}
  # A new dataset seed per rate: the same prompts again would hit the server's prefix
  # cache and measure a warm cache instead of GPU-S.
  seed=$((seed + 1))
  python3 -m kvflow.cli bench serve --base-url http://127.0.0.1:8000 --model llama-3.1-8b \
    --num-prompts "$n" --input-len 1024 --output-len 128 --range-ratio 0.5 \
    --request-rate "$rate" --seed "$seed" --num-warmups 4 --metadata "server=$SERVE" \
    --save-result "$OUT/gpu-s-rate-$rate.json" 2>&1 | tail -22
done
kill -INT $SERVER; wait $SERVER
grep -E "engine step|throughput" "$OUT/server.log" | tail -5
