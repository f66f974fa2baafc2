"""The ablation report: a markdown table and PNG plots from ``ablation.json``."""

from __future__ import annotations

import os


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def markdown(result: dict, plots: list[str]) -> str:
    rows = result["configurations"]
    base = next((r for r in rows if r["name"] == "baseline" and "error" not in r), None)
    w = result["workload"]
    m = result.get("machine", {})
    lines = [
        "# kvflow optimization ablation", "",
        f"Model `{result['engine_args'].get('model')}` on "
        f"{m.get('cpu') if rows and rows[0].get('device') == 'cpu' else m.get('gpu', '')}"
        f" ({m.get('cpu_count', '?')} CPU cores), torch {m.get('torch', '?')}; commit "
        f"`{str(result.get('commit', ''))[:10]}`, {result.get('date', '')}, load average "
        f"{result.get('loadavg', '?')}.", "",
        f"Workload: {w['num_prompts']} requests arriving at once, prompts of "
        f"{w['input_len_range'][0]}..{w['input_len_range'][1]} tokens (the first "
        f"{w['prefix_len']} shared by all), {w['output_len_range'][0]}.."
        f"{w['output_len_range'][1]} output tokens each (ignore_eos), temperature "
        f"{w['temperature']}. TTFT counts from the common arrival (queueing included).", "",
        f"Command: `{result.get('command', '')}`", "",
        "| configuration | switched off | output tok/s | vs baseline | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | peak KV (MiB) | prefix hits | preemptions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['off']} | failed | | | | | | |")
            continue
        ratio = (f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x"
                 if base else "")
        lines.append(
            f"| {r['name']} | {r['off']} | {r['output_tokens_per_s']:.1f} | {ratio} | "
            f"{r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['median']:.1f} / {r['tpot_ms']['p99']:.1f} | "
            f"{r['kv_peak_mib']:.1f} of {r['kv_cache_mib']:.0f} | "
            f"{100 * r['prefix_cache_hit_rate']:.0f}% | {r['preemptions']} |")
    lines.append("")
    for p in plots:
        lines.append(f"![{os.path.splitext(p)[0]}]({p})")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, out_dir: str) -> list[str]:
    """Bars per configuration and throughput against latency; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = _ok(result["configurations"])
    if not rows:
        return []
    names = [r["name"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    panels = [("output tokens/s", [r["output_tokens_per_s"] for r in rows], None),
              ("TTFT ms (p50, p99)", [r["ttft_ms"]["median"] for r in rows],
               [r["ttft_ms"]["p99"] for r in rows]),
              ("TPOT ms (p50, p99)", [r["tpot_ms"]["median"] for r in rows],
               [r["tpot_ms"]["p99"] for r in rows]),
              ("peak KV MiB", [r["kv_peak_mib"] for r in rows], None)]
    for ax, (title, first, second) in zip(axes, panels):
        width = 0.4 if second else 0.7
        ax.bar([i - (width / 2 if second else 0) for i in x], first, width, label="p50"
               if second else None, color="#3b6ea8")
        if second:
            ax.bar([i + width / 2 for i in x], second, width, label="p99", color="#d08a2e")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    fig.tight_layout()
    bars = "ablation-bars.png"
    fig.savefig(os.path.join(out_dir, bars), dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        ax.scatter(r["output_tokens_per_s"], r["tpot_ms"]["p99"], s=40)
        ax.annotate(r["name"], (r["output_tokens_per_s"], r["tpot_ms"]["p99"]),
                    fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("p99 TPOT (ms)")
    ax.set_title("throughput vs latency per configuration", fontsize=10)
    fig.tight_layout()
    scatter = "ablation-throughput-latency.png"
    fig.savefig(os.path.join(out_dir, scatter), dpi=90)
    plt.close(fig)
    return [bars, scatter]


def write_report(result: dict, out_dir: str) -> str:
    plots = plot(result, out_dir)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown(result, plots))
    return path
