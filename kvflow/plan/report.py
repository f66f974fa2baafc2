"""The plan as a terminal table, a JSON document, and a throughput-latency chart."""

from __future__ import annotations

import dataclasses

from kvflow.config import GiB
from kvflow.errors import InvalidParameterError
from kvflow.plan.model import DTYPE_BYTES, StepCost, decode_step
from kvflow.plan.planner import Plan

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8",
          "int8": "int8"}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_table(plan: Plan) -> str:
    """The terminal report."""
    i, m, mem, gpu = plan.inputs, plan.model, plan.memory, plan.inputs.gpu
    a = m.arch
    kvb = (f"{DTYPE_BYTES[m.kv_dtype]} B" if m.kv_dtype != "int8"
           else "(1 B + a 4 B scale per head)")
    seq = i.input_len + i.output_len
    weights = (_SHORT[m.dtype] if m.stored_bytes_per_param is None else
               f"GGUF as stored, {8 * m.stored_bytes_per_param:.2f} bits per")
    lines = [
        f"kvflow plan: {i.model} on {m.tp} x {gpu.name} ({weights} weights, "
        f"{_SHORT[m.kv_dtype]} KV cache)",
        f"  GPU: {gpu.memory_bytes / GiB:.1f} GiB, {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"{gpu.flops_per_s(m.dtype) / 1e12:.0f} TFLOP/s {_SHORT[m.dtype]}",
        f"       {gpu.source}",
        f"  model: {a.num_params / 1e9:.2f} B parameters, {a.num_hidden_layers} layers, "
        f"{a.num_attention_heads} heads, {a.num_key_value_heads} KV heads x {a.head_dim}",
        *([f"  experts: {a.num_experts} per MoE layer ({m.moe_layers} of them), top-"
           f"{a.num_experts_per_tok}: {a.num_active_params / 1e9:.2f} B active parameters "
           f"per token; batch-1 decode reads {m.weight_read_bytes(1) / GiB:.2f} GiB per "
           f"GPU of {m.weight_bytes / GiB:.2f} GiB"] if a.num_experts else []),
        "",
        "Memory per GPU",
        f"  KV cache per token       {m.model_kv_bytes_per_token / 1024:.1f} KiB  (2 x "
        f"{a.num_hidden_layers} layers x {a.num_key_value_heads} KV heads x {a.head_dim} x "
        f"{kvb})" + (f"; {m.kv_bytes_per_token / 1024:.1f} KiB on each GPU "
                       f"({m.kv_heads} KV head{'s' if m.kv_heads > 1 else ''})"
                       if m.tp > 1 else ""),
        f"  usable                   {_gib(mem.usable_bytes)}  ({i.gpu_memory_utilization:g} "
        f"x {_gib(mem.total_bytes)})",
        f"  weights                  {_gib(mem.weight_bytes)}  (+ {_gib(mem.buffer_bytes)} "
        f"rotary and block tables"
        + (f", + {_gib(mem.lora_bytes)} LoRA slots)" if mem.lora_bytes else ")"),
        f"  activations              {_gib(mem.activation_bytes)}  (larger of: forward "
        f"pass of {i.max_num_batched_tokens} tokens {_gib(mem.forward_activation_bytes)}, "
        f"sampling {i.max_num_seqs} rows {_gib(mem.sampler_bytes)})",
        f"  reserves                 {_gib(mem.graph_reserve_bytes + mem.non_torch_bytes)}  "
        f"(CUDA graphs {_gib(mem.graph_reserve_bytes)}, outside torch "
        f"{_gib(mem.non_torch_bytes)})",
        f"  KV cache                 {_gib(max(0, mem.kv_budget_bytes))} = "
        f"{mem.kv_tokens:,} tokens ({mem.num_blocks:,} blocks of {mem.block_size})",
        f"  max concurrency          {plan.concurrency_at_max_model_len:.2f}x at "
        f"max_model_len={i.model_len}; {plan.max_batch:,} requests of {i.input_len} + "
        f"{i.output_len} = {seq} tokens",
        "",
        f"Decode, per step, at context {plan.decode[0].context:g} (input + output / 2); "
        "bound = roofline, predicted = measured overheads added",
    ]
    header = (f"  {'batch':>5}  {'fits':>4}  {'bound ms':>8}  {'binds':>7}  {'pred ms':>8}  "
              f"{'tok/s/stream':>12}  {'total tok/s':>11}  {'bound tok/s':>11}")
    if m.tp > 1:
        header += f"  {'all-reduce MB':>13}"
    lines.append(header)
    for r in plan.decode:
        row = (f"  {r.batch:>5}  {'yes' if r.fits else 'no':>4}  {r.bound_ms:>8.2f}  "
               f"{r.cost.binding:>7}  {r.predicted_ms:>8.2f}  {r.stream_tokens_per_s:>12.1f}  "
               f"{r.total_tokens_per_s:>11,.0f}  {r.bound_total_tokens_per_s:>11,.0f}")
        if m.tp > 1:
            row += f"  {r.cost.allreduce_bytes / 1e6:>13.2f}"
        lines.append(row)
    p = plan.prefill
    chunks = f" in {len(p.steps)} chunks" if len(p.steps) > 1 else ""
    lines += [
        "",
        f"Prefill of one {p.tokens}-token prompt{chunks}: bound {p.bound_s * 1e3:.2f} ms "
        f"({p.binding}), predicted GPU time {p.gpu_s * 1e3:.2f} ms; TTFT on an idle engine "
        f"~{p.ttft_s * 1e3:.1f} ms (prefill runs eagerly: at least {a.num_hidden_layers} "
        f"layers x {i.efficiency.eager_launch_s_per_layer * 1e3:.2f} ms of kernel launches)",
    ]
    o = plan.offline
    if o is not None:
        lines.append(
            f"Offline run of {o.num_prompts} requests sent at once: ~{o.elapsed_s:.1f} s in "
            f"{o.steps} steps, {o.requests_per_s:.1f} requests/s, {o.total_tokens_per_s:,.0f} "
            f"total tokens/s, {o.output_tokens_per_s:,.0f} output tokens/s (a simulated "
            "schedule; optimistic: host work per request is not modelled)"
            if o.steps else f"Offline run of {o.num_prompts} requests: no request fits")
    if m.tp > 1:
        ar = sum(s.allreduce_bytes for s in p.steps)
        lines.append(f"Tensor parallel {m.tp}: 2 all-reduces per layer (+1 for the "
                     f"embedding) of tokens x {a.hidden_size} x {m.dtype_bytes} B; each GPU "
                     f"sends 2(N-1)/N of each: {plan.decode[0].cost.allreduce_bytes / 1e6:.3f}"
                     f" MB per decode step at batch {plan.decode[0].batch}, {ar / 1e6:.1f} MB "
                     "for the prefill")
        for r in plan.decode:
            c = r.cost
            lines.append(f"  batch {r.batch:>4}: {c.allreduce_count} all-reduces x "
                         f"{_fmt_bytes(c.allreduce_message_bytes)} per step, "
                         f"{c.breakdown.get('allreduce', 0.0) * 1e3:.3f} ms at the link's "
                         "latency and bandwidth (check with kvflow bench allreduce)")
    if plan.notes:
        lines += [""] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _cost_dict(c: StepCost) -> dict:
    return {"bound_ms": c.bound_s * 1e3, "binding": c.binding, "predicted_ms":
            c.predicted_s * 1e3, "bytes": c.bytes, "flops": c.flops,
            "allreduce_bytes_per_gpu": c.allreduce_bytes,
            "allreduce_count": c.allreduce_count,
            "allreduce_message_bytes": c.allreduce_message_bytes,
            "allreduce_ms": c.breakdown.get("allreduce", 0.0) * 1e3,
            "predicted_breakdown_ms": {k: v * 1e3 for k, v in c.breakdown.items()}}


def plan_to_dict(plan: Plan) -> dict:
    """Everything in the table, plus the constants behind it, as plain JSON data."""
    i, m, mem = plan.inputs, plan.model, plan.memory
    inputs = {f.name: getattr(i, f.name) for f in dataclasses.fields(i)
              if f.name not in ("arch", "gpu", "efficiency")}
    inputs.update(max_model_len=i.model_len, kv_dtype=m.kv_dtype,
                  batch_sizes=list(i.batch_sizes))
    return {
        "inputs": inputs,
        "gpu": dataclasses.asdict(i.gpu),
        "efficiency": dataclasses.asdict(i.efficiency),
        "model": {"architecture": m.arch.architecture, "num_params": m.arch.num_params,
                  "num_active_params": m.arch.num_active_params,
                  "num_experts": m.arch.num_experts,
                  "experts_per_token": m.arch.num_experts_per_tok,
                  "decode_batch1_read_bytes_per_gpu": m.weight_read_bytes(1),
                  "num_params_per_gpu": m.num_params, "layers": m.arch.num_hidden_layers,
                  "kv_heads": m.arch.num_key_value_heads, "kv_heads_per_gpu": m.kv_heads,
                  "head_dim": m.arch.head_dim},
        "kv_bytes_per_token": m.model_kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": m.kv_bytes_per_token,
        "memory": {**dataclasses.asdict(mem), "activation_bytes": mem.activation_bytes,
                   "kv_tokens": mem.kv_tokens},
        "max_concurrency": {"at_max_model_len": plan.concurrency_at_max_model_len,
                            "requests_at_input_plus_output": plan.max_batch},
        "decode": [{"batch": r.batch, "context": r.context, "fits": r.fits,
                    "stream_tokens_per_s": r.stream_tokens_per_s,
                    "total_tokens_per_s": r.total_tokens_per_s,
                    "bound_total_tokens_per_s": r.bound_total_tokens_per_s,
                    **_cost_dict(r.cost)} for r in plan.decode],
        "prefill": {"tokens": plan.prefill.tokens, "bound_ms": plan.prefill.bound_s * 1e3,
                    "binding": plan.prefill.binding, "gpu_ms": plan.prefill.gpu_s * 1e3,
                    "ttft_ms": plan.prefill.ttft_s * 1e3,
                    "steps": [_cost_dict(s) for s in plan.prefill.steps]},
        "offline": None if plan.offline is None else {
            **dataclasses.asdict(plan.offline), "requests_per_s": plan.offline.requests_per_s,
            "total_tokens_per_s": plan.offline.total_tokens_per_s,
            "output_tokens_per_s": plan.offline.output_tokens_per_s},
        "notes": list(plan.notes),
    }


def write_plot(plan: Plan, path: str) -> None:
    """Total tokens/s against ms per token, one point per batch size, memory limit marked."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidParameterError(
            "--plot needs matplotlib, which is not installed: pip install 'kvflow[plot]' "
            "(or pip install matplotlib)", param="plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    i = plan.inputs
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for fits, style in ((True, dict(color="tab:blue", label="predicted (fits in memory)")),
                        (False, dict(color="tab:gray", label="predicted (KV does not fit)"))):
        rows = [r for r in plan.decode if r.fits == fits]
        if rows:
            ax.plot([r.predicted_ms for r in rows], [r.total_tokens_per_s for r in rows],
                    "o-", **style)
    ax.plot([r.bound_ms for r in plan.decode], [r.bound_total_tokens_per_s
                                                for r in plan.decode],
            "--", color="tab:green", alpha=0.6, label="roofline bound")
    for r in plan.decode:
        ax.annotate(str(r.batch), (r.predicted_ms, r.total_tokens_per_s),
                    textcoords="offset points", xytext=(5, -10), fontsize=8)
    label = (f"KV memory limit: {plan.max_batch:,} requests of "
             f"{i.input_len + i.output_len} tokens")
    if 1 <= plan.max_batch <= plan.decode[-1].batch:
        limit = decode_step(plan.model, i.gpu, i.efficiency, plan.max_batch,
                            i.average_context)
        ax.axvline(limit.predicted_s * 1e3, color="tab:red", ls=":", label=label)
    else:  # the limit lies beyond the largest batch shown (or nothing fits)
        ax.plot([], [], " ", label=label + (" (beyond this chart)" if plan.max_batch else ""))
    ax.set_xlabel("per-token latency (ms per decode step)")
    ax.set_ylabel("total decode throughput (tokens/s)")
    ax.set_title(f"{i.model} on {plan.model.tp} x {i.gpu.name}: {i.input_len} in / "
                 f"{i.output_len} out, by batch size", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
