"""Results as Markdown: one table per benchmark, ratios to the baseline beside the values (of the
medians, and paired: the median of each repeat's own ratio)."""

from __future__ import annotations

import statistics


def fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def ms(value_s) -> str:
    return "-" if value_s is None else f"{value_s * 1000:.0f}"


def times(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def paired(row: dict, key: str) -> float | None:
    """The median of each repeat's own ratio to the baseline's same repeat (the repeats take turns,
    so each pair saw the same minutes of a noisy box)."""
    values = _per_repeat(row, key)
    return statistics.median(values) if values else None


def paired_range(row: dict, key: str) -> tuple[float, float] | None:
    """The lowest and highest repeat's own ratio: how far one repeat can be trusted on this box."""
    values = _per_repeat(row, key)
    return (values[0], values[-1]) if len(values) >= 2 else None


def _per_repeat(row: dict, key: str) -> list[float]:
    return sorted(v for v in row.get("vs_baseline_per_repeat", {}).get(key, []) if v is not None)


def span(bounds: tuple[float, float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}x"


def transitions_cell(row: dict) -> str:
    t = row.get("transitions") or {}
    if not t:
        return "-"
    keys = (("num_preempts", "pre"), ("num_resumes", "res"), ("num_capture_rounds", "cap"),
            ("num_gated_rounds", "gated"))
    return " ".join(f"{short} {t[k]:.0f}" for k, short in keys if t.get(k) is not None)


def results_table(results: dict) -> str:
    """A Markdown table of results["table"], with ratios to the baseline target."""
    rows = results["table"]
    has_levels = any(r["level"] is not None for r in rows)
    has_arrivals = any(r.get("arrival_ttft_p95_s") is not None for r in rows)
    head = (["conc."] if has_levels else []) + [
        "target", "agg tok/s", "x base", "x base paired", "repeats' range", "TTFT p50 ms", "TTFT p95 ms", "p95 x base", "TTFT p99 ms",
        "ITL p50 ms", "stream tok/s p50", "acceptance"]
    if has_arrivals:
        head += ["arrivals TTFT p95 ms", "x base", "lone stream tok/s"]
    has_transport = any(r.get("transport_p95_s") is not None for r in rows)
    if has_transport:
        head += ["IPC delay p95 ms"]
    head += ["transitions (median per run)", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vs = r["vs_baseline"]
        cells = ([str(r["level"])] if has_levels else []) + [
            r["target"], fmt(r["aggregate_tok_per_s"], ".1f"), times(vs["aggregate_tok_per_s"]),
            times(paired(r, "aggregate_tok_per_s")), span(paired_range(r, "aggregate_tok_per_s")),
            ms(r["ttft_p50_s"]), ms(r["ttft_p95_s"]), times(vs["ttft_p95_s"]), ms(r["ttft_p99_s"]),
            fmt(None if r["itl_p50_s"] is None else r["itl_p50_s"] * 1000, ".1f"),
            fmt(r["stream_tok_per_s_p50"], ".1f"), fmt(r["acceptance_rate"], ".2f")]
        if has_arrivals:
            cells += [ms(r["arrival_ttft_p95_s"]), times(vs["arrival_ttft_p95_s"]),
                      fmt(r["long_stream_tok_per_s"], ".1f")]
        if has_transport:
            cells += [fmt(None if r.get("transport_p95_s") is None else r["transport_p95_s"] * 1000, ".1f")]
        cells += [transitions_cell(r), str(r["num_errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def knee(results: dict, target: str, fraction: float = 0.9) -> dict | None:
    """The smallest concurrency reaching `fraction` of the target's best aggregate tok/s."""
    points = sorted((r["level"], r["aggregate_tok_per_s"]) for r in results["table"]
                    if r["target"] == target and r["level"] is not None and r["aggregate_tok_per_s"])
    if not points:
        return None
    best = max(tok for _, tok in points)
    level = next(lv for lv, tok in points if tok >= fraction * best)
    return {"target": target, "knee_concurrency": level, "best_tok_per_s": best, "fraction": fraction}


def workload_line(results: dict) -> str:
    w = results["workload"]
    parts = [f"load {w['kind']}"]
    if w.get("concurrency_levels") and w["concurrency_levels"][0] is not None:
        parts.append("concurrency " + ",".join(str(c) for c in w["concurrency_levels"]))
    for key in ("num_requests", "requests_per_client", "rate_per_s", "burst_size", "burst_interval_s",
                "long_max_tokens", "arrival_delay_s", "arrival_interval_s", "prompt_source", "prompt_tokens",
                "max_tokens", "temperature", "repeats", "seed"):
        if key == "num_requests" and w.get("requests_per_client"):
            continue  # a sweep: the count is per level
        if w.get(key) is not None:
            parts.append(f"{key} {w[key]}")
    if w.get("ignore_eos"):
        parts.append("EOS ignored")
    return ", ".join(parts)


def formats_lines(results: dict) -> list[str]:
    """One line per target saying the weights' format it computes in (where the target knows it)."""
    return [f"- {t['name']}: {t['format']}" for t in results["targets"] if t.get("format")]
