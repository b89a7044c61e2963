"""Readable output of `attnkit bench`: side-by-side table, model ÷ baseline ratios, PNG plot."""

from __future__ import annotations

from pathlib import Path


def _key(row: dict) -> tuple[int, int]:
    return row["context"], row["batch"]


def compare(model: dict, baseline: dict) -> list[dict]:
    """Per (context, batch) where both ran: decode and prefill speed ratios, cache ratio (model ÷ baseline)."""
    base = {_key(r): r for r in baseline["results"] if r["status"] == "ok"}
    out = []
    for row in model["results"]:
        other = base.get(_key(row))
        if row["status"] != "ok" or other is None:
            continue
        out.append({
            "context": row["context"], "batch": row["batch"],
            "decode_speedup": row["decode_tokens_per_s"]["median"] / other["decode_tokens_per_s"]["median"],
            "prefill_speedup": row["prefill_tokens_per_s"]["median"] / other["prefill_tokens_per_s"]["median"],
            "kv_cache_ratio": row["kv_cache_bytes"] / other["kv_cache_bytes"],
        })
    return out


def kv_line(info: dict) -> str:
    """'608 B/token (bf16, as stored); 1,216 B/token (fp32, in this run)': the figure convert and eval print,
    then the one measured here (the KV MB column's) when this run's --dtype is not the stored one."""
    from attnkit.evaluation.kv import format_kv, short_dtype

    stored = (info["kv_cache_bytes_per_token"], short_dtype(info.get("kv_cache_dtype") or info["dtype"]))
    measured = info.get("kv_cache_measured") or {}
    line = format_kv(*stored, "as stored")
    if measured and (measured["bytes_per_token"], short_dtype(measured["dtype"])) != stored:
        line += f"; {format_kv(measured['bytes_per_token'], measured['dtype'], 'in this run')}"
    return line


def _cell(row: dict | None) -> list[str]:
    if row is None:
        return ["-"] * 6
    if row["status"] != "ok":
        return [row["status"].upper()] + [""] * 5
    dec = row["decode_tokens_per_s"]
    return [
        f"{row['prefill_tokens_per_s']['median']:.0f}",
        f"{dec['median']:.1f} ±{100 * dec['spread'] / 2:.0f}%",
        f"{row['kv_cache_bytes'] / 2**20:.3g}",
        f"{row['peak_memory_mb']['median']:.0f}",
        f"{row['attention_decode_s']['median'] * 1e3:.0f}",
        f"{row['attention_vs_bound']:.1f}x",
    ]


def format_table(result: dict) -> str:
    """A fixed-width table: one line per (context, batch), model and baseline side by side."""
    models = result["models"]
    labels = list(models)
    head = ["prefill tok/s", "decode tok/s", "KV MB", "peak MB", "attn ms", "attn/bound"]
    cols = ["context", "batch"] + [f"{lab}: {h}" for lab in labels for h in head]
    if "comparison" in result:
        cols.append("decode x")
    lines = []
    for info_label in labels:
        info = models[info_label]
        lines.append(f"{info_label}: {info['name']} — {info['attn_path']}; KV cache {kv_line(info)}")
    bw = result["machine"]["memory_bandwidth"]["bytes_per_s"]
    lines.append(f"device {result['machine']['device']}, {result['machine']['threads']} threads, "
                 f"{result.get('clock', 'wall')} clock, "
                 f"copy bandwidth {bw / 1e9:.1f} GB/s; ± is half the min-max spread over repeats")
    by_label = {lab: {_key(r): r for r in models[lab]["results"]} for lab in labels}
    speed = {_key(c): c["decode_speedup"] for c in result.get("comparison", [])}
    rows = []
    for key in [_key(r) for r in models[labels[0]]["results"]]:
        cells = [str(key[0]), str(key[1])] + [c for lab in labels for c in _cell(by_label[lab].get(key))]
        if "comparison" in result:
            cells.append(f"{speed[key]:.2f}" if key in speed else "-")
        rows.append(cells)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    lines += [fmt(cols), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    return "\n".join(lines)


def write_plot(result: dict, png: Path) -> Path:
    """Decode tokens/s and KV-cache MB vs context length, one line per model × batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, info in result["models"].items():
        for batch in sorted({r["batch"] for r in info["results"]}):
            ok = [r for r in info["results"] if r["batch"] == batch and r["status"] == "ok"]
            if not ok:
                continue
            ctx = [r["context"] for r in ok]
            name = f"{label} ({info['name']}), batch {batch}"
            ax_speed.plot(ctx, [r["decode_tokens_per_s"]["median"] for r in ok], marker="o", label=name)
            ax_mem.plot(ctx, [r["kv_cache_bytes"] / 2**20 for r in ok], marker="o", label=name)
    for ax, title in ((ax_speed, "decode tokens/s"), (ax_mem, "KV cache MB (measured)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if ax_speed.get_legend_handles_labels()[0]:  # nothing to label when every case ran out of memory
        ax_speed.legend(fontsize=7)
    fig.suptitle(f"attnkit bench on {result['machine']['device']}, {result['machine']['threads']} threads")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
