"""CPU-A / CPU-B with the C++ step's step routing of before 2026-12-07 (steps with a
query over 64 tokens or over 256 tokens in all ran eagerly) or today's (every step in
C++): the cost of batch invariance on CPU (docs/determinism.md).

    python benchmarks/cpu_step_routing_ab.py before|after RUN a|b
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import kvflow.cpu.step as cpu_step  # noqa: E402
from kvflow.cli import main  # noqa: E402

variant, run, which = sys.argv[1], sys.argv[2], sys.argv[3]
if variant == "before":
    def build(self, meta, positions, *, split_context=None):
        if meta.num_actual_tokens <= 256 and meta.max_query_len <= 64:
            meta.backend = cpu_step.CPP_PLAN
            return meta
        return self.inner.build(meta, positions, split_context=split_context)
    cpu_step.CppMetadataBuilder.build = build
if which == "b":
    argv = ["bench", "throughput", "--num-prompts", "64", "--min-input-len", "16",
            "--max-input-len", "512", "--min-output-len", "16", "--max-output-len", "256",
            "--seed", "0"]
else:
    argv = ["bench", "latency", "--backend", "kvflow", "--chat-prompt",
            "Write a short story about a robot who learns to paint.", "--output-len", "128",
            "--num-iters", "3"]
sys.exit(main(argv + ["--save-result",
                      f"benchmarks/results/cpu-{which}-routing-{variant}-run{run}.json"]))
