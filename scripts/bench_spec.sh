#!/usr/bin/env bash
# Speculative decoding on CPU with the embedded model (docs/speculative.md). Each run
# measures kvflow with and without speculation in the same invocation (--spec-baseline),
# under the shared benchmark lock.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
NGRAM_ALWAYS='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "disable_by_batch_size": null}'
DRAFT='{"method": "draft_model", "model": "smollm2-135m", "draft_quantization": "gguf", "num_speculative_tokens": 3}'
COMMON=(--max-model-len 1024 --kv-cache-memory 512MiB)
bench() { flock /tmp/kvflow-bench.lock "$PY" -m kvflow.cli bench throughput "${COMMON[@]}" "$@"; }
# Batch 1 (one request at a time): free chat, then copy-with-edits.
bench --dataset chat --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$NGRAM" --spec-baseline --save-result "$OUT/spec-ngram-chat-bs1-cpu.json"
bench --dataset edit --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$NGRAM" --spec-baseline --save-result "$OUT/spec-ngram-edit-bs1-cpu.json"
# Batch 64: speculation switches itself off above disable_by_batch_size (default 8) ...
bench --dataset chat --num-prompts 64 --output-len 24 --max-num-seqs 64 \
  --speculative-config "$NGRAM" --spec-baseline --save-result "$OUT/spec-ngram-chat-bs64-cpu.json"
# ... and this is what verifying drafts at batch 64 would cost without that switch.
bench --dataset chat --num-prompts 64 --output-len 24 --max-num-seqs 64 \
  --speculative-config "$NGRAM_ALWAYS" --spec-baseline \
  --save-result "$OUT/spec-ngram-always-chat-bs64-cpu.json"
# draft_model: the dense target (--quantization none) verifying drafts of its own 4-bit
# GGUF copy (the only real model on CPU is the embedded one), against the dense target.
bench --quantization none --dataset chat --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$DRAFT" --spec-baseline --save-result "$OUT/spec-draft-chat-bs1-cpu.json"
# medusa: heads trained here (kvflow train-medusa: 3 answers per prompt, the answers
# are cached so a retrain skips generation), chat bs1 as a chain (exact rejection
# sampling) and as candidate trees (the CPU default of 8 nodes, and 4), and bs64.
HEADS=${HEADS:-heads/smollm2-medusa3}
[ -f "$HEADS/config.json" ] || nice -n 19 "$PY" -m kvflow.cli train-medusa --output "$HEADS" \
  --num-heads 3 --max-tokens 128 --epochs 4 --samples-per-prompt 3 --batch-size 512 \
  --data-cache "$HEADS.answers.json"
medusa() { echo "{\"method\": \"medusa\", \"model\": \"$HEADS\", \"num_speculative_tokens\": ${2:-3}, \"medusa_tree\": $1}"; }
bench --dataset chat --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$(medusa '"chain"' 2)" --spec-baseline --save-result "$OUT/spec-medusa-chain-chat-bs1-cpu.json"
bench --dataset chat --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$(medusa null)" --spec-baseline --save-result "$OUT/spec-medusa-tree8-chat-bs1-cpu.json"
bench --dataset chat --num-prompts 3 --output-len 48 --max-num-seqs 1 \
  --speculative-config "$(medusa 4)" --spec-baseline --save-result "$OUT/spec-medusa-tree4-chat-bs1-cpu.json"
bench --dataset chat --num-prompts 64 --output-len 24 --max-num-seqs 64 \
  --speculative-config "$(medusa null)" --spec-baseline --save-result "$OUT/spec-medusa-chat-bs64-cpu.json"
# eagle_mlp: a feature-level draft head trained here (kvflow train-eagle), chat bs1 with
# k = 3 (always) and k = 3 with draft_confidence (drafts only where the head is sure),
# and bs64 (speculation switches itself off above disable_by_batch_size).
EAGLE=${EAGLE:-heads/smollm2-eagle}
[ -f "$EAGLE/config.json" ] || nice -n 19 "$PY" -m kvflow.cli train-eagle --output "$EAGLE" \
  --data-cache "$EAGLE.answers.json"
eagle() { echo "{\"method\": \"eagle_mlp\", \"model\": \"$EAGLE\", \"num_speculative_tokens\": ${1:-3}, \"draft_confidence\": ${2:-0}}"; }
for k in 1 2 3; do
  bench --dataset chat --num-prompts 5 --output-len 64 --max-num-seqs 1 \
    --speculative-config "$(eagle $k 0)" --spec-baseline --save-result "$OUT/spec-eagle-k$k-chat-bs1-cpu.json"
done
for kc in "1 0.7" "2 0.6" "3 0.6"; do
  set -- $kc
  bench --dataset chat --num-prompts 5 --output-len 64 --max-num-seqs 1 \
    --speculative-config "$(eagle $1 $2)" --spec-baseline --save-result "$OUT/spec-eagle-k$1-conf$2-chat-bs1-cpu.json"
done
bench --dataset chat --num-prompts 64 --output-len 64 --max-num-seqs 64 \
  --speculative-config "$(eagle 3 0.6)" --spec-baseline --save-result "$OUT/spec-eagle-chat-bs64-cpu.json"
