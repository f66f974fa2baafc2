#!/usr/bin/env bash
# Tensor-parallel GPU runs for a machine with 2+ GPUs: `benchmarks/gpu/tp.sh STAGE...`,
# results under $OUT (default ./gpu-out). Stages:
#   allreduce  the engine's NCCL all-reduce at 16 KB / 256 KB / 1 MB / 16 MB on 2 GPUs,
#              beside the planner's figure (kvflow plan uses datasheet link figures)
#   test       TP 2 equals TP 1 on the GPU (CUDA graphs with NCCL inside, async steps);
#              PP 2 with two batches in flight equals TP 1 (NCCL sends between stages)
#   tp-a       GPU-A latency (Llama-3.1-8B bf16, batch 1, 128 in / 256 out): TP 1 then TP 2
#   tp-70b     Llama-3.1-70B bf16 over 2 GPUs: batch-1 latency and GPU-B-style throughput
#   pp         Llama-3.1-8B over 2 GPUs as 2 pipeline stages: throughput with two batches
#              in flight (one per stage) against one at a time, and TP 1 on one GPU
#   plan       the planner's predictions for the same runs, to put beside them
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/gpu/env.sh  # OUT, PYTHONPATH, KVFLOW_GIT_COMMIT, KV
LAT="bench latency --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --max-model-len 4096"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    allreduce) $KV bench allreduce --device cuda --world-size 2 --dtype bfloat16 --iters 200 --save-result "$OUT/allreduce-nccl-2gpu.json" 2>&1 | tail -6;;
    test) python -m pytest tests/test_distributed_gpu.py -q -x 2>&1 | tail -15;;
    tp-a) for tp in 1 2; do $KV $LAT --model llama-3.1-8b -tp $tp --save-result "$OUT/gpu-a-tp$tp-h200.json" 2>&1 | grep -v "^INFO" | tail -4; done;;
    tp-70b)
      $KV $LAT --model llama-3.1-70b -tp 2 --save-result "$OUT/gpu-a-70b-tp2-h200.json" 2>&1 | grep -v "^INFO" | tail -4
      $KV bench throughput --model llama-3.1-70b --load-format dummy -tp 2 --num-prompts ${TP_70B_PROMPTS:-500} --input-len 1024 --output-len 128 --max-model-len 4096 --save-result "$OUT/gpu-b-70b-tp2-h200.json" 2>&1 | grep -v "^INFO" | tail -6;;
    pp)
      TPUT="bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${PP_PROMPTS:-400} --input-len 512 --output-len 128 --max-model-len 4096"
      for inflight in 2 1; do $KV $TPUT -pp 2 --pipeline-in-flight $inflight --save-result "$OUT/pp2-inflight$inflight-8b-h200.json" 2>&1 | grep -v "^INFO" | tail -3; done
      $KV $TPUT --save-result "$OUT/pp1-8b-h200.json" 2>&1 | grep -v "^INFO" | tail -3;;
    plan) for m in llama-3.1-8b llama-3.1-70b; do $KV plan --model $m -tp 2 --batch-sizes 1,64 --json "$OUT/plan-$m-tp2.json" | tail -8; done; $KV plan --model llama-3.1-8b --batch-sizes 1,64 --json "$OUT/plan-llama-3.1-8b-tp1.json" | tail -4;;
    *) echo "unknown stage $stage"; exit 2;;
  esac
done
