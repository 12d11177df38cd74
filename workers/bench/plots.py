"""PNG plots through the optional matplotlib extra (`pip install -e .[plot]`).

make_plots() returns the files it wrote, or says why it wrote none; without matplotlib the
benchmark still runs and its JSON and tables are complete.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from workers.bench.metrics import EVENT_KINDS

logger = logging.getLogger(__name__)

EVENT_COLORS = {"preempt": "tab:red", "gate": "tab:orange", "capture": "tab:blue", "resume": "tab:green"}
EVENT_STYLES = {"preempt": "-", "gate": "-", "capture": ":", "resume": "--"}  # a resume and its capture coincide


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def make_plots(results: dict, out_dir: Path, prefix: str = "bench") -> tuple[list[Path], str | None]:
    """(written files, None) or ([], the reason plots were skipped)."""
    plt = _pyplot()
    if plt is None:
        return [], "matplotlib is not installed (pip install -e .[plot]); plots skipped"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    levels = {r["level"] for r in results["table"]}
    if len(levels) > 1 and None not in levels:
        written.append(throughput_vs_concurrency(plt, results, out_dir / f"{prefix}-throughput.png"))
    for run in _timeline_runs(results):
        slug = re.sub(r"[^a-zA-Z0-9]+", "-", run["target"]).strip("-")
        level = f"-c{run['level']}" if run["level"] is not None else ""
        written.append(timeline(plt, run, out_dir / f"{prefix}-timeline-{slug}{level}.png"))
    return written, None


def _timeline_runs(results: dict) -> list[dict]:
    """One run per target (first repeat); in a sweep, the widest level that still reads (<= 8 streams)."""
    def score(run: dict) -> int:
        level = run["level"]
        return 0 if level is None else (level if level <= 8 else -level)

    chosen: dict[str, dict] = {}
    for run in results["runs"]:
        best = chosen.get(run["target"])
        if run["repeat"] == 0 and (best is None or score(run) > score(best)):
            chosen[run["target"]] = run
    return list(chosen.values())


def throughput_vs_concurrency(plt, results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in dict.fromkeys(r["target"] for r in results["table"]):
        points = sorted((r["level"], r["aggregate_tok_per_s"]) for r in results["table"]
                        if r["target"] == target and r["aggregate_tok_per_s"])
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=target)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Throughput vs concurrency (median over repeats)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def timeline(plt, run: dict, path: Path) -> Path:
    """One line per stream from arrival to finish, a tick per token chunk, and the engine's
    transitions (preempt, gate, capture, resume) as vertical lines."""
    streams = run["streams"]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.35 * max(len(streams), 2)))
    for y, s in enumerate(streams):
        end_s = s["finish_s"] if s["finish_s"] is not None else s["arrival_s"]
        first_s = s["chunk_times_s"][0] if s["chunk_times_s"] else end_s
        ax.plot([s["arrival_s"], first_s], [y, y], color="0.6", linestyle=":", linewidth=1)
        ax.plot([first_s, end_s], [y, y], color="0.3", linewidth=1)
        ax.scatter(s["chunk_times_s"], [y] * len(s["chunk_times_s"]), s=[4 + 3 * n for n in s["chunk_tokens"]],
                   color="k", marker="|")
    labelled = set()
    for event in run["events"]:
        kind = event["kind"]
        if kind not in EVENT_KINDS:
            continue
        ax.axvline(event["time_s"], color=EVENT_COLORS[kind], linestyle=EVENT_STYLES[kind], alpha=0.8,
                   linewidth=1.5 if kind == "resume" else 1, label=None if kind in labelled else kind)
        labelled.add(kind)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([_stream_label(s) for s in streams], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started (dotted: waiting for the first token)")
    note = "" if run["events"] else " (no transition events from this target)"
    ax.set_title(f"{run['target']}: per-stream timeline{note}", fontsize=9)
    if labelled:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.debug("wrote %s", path)
    return path


def _stream_label(stream: dict) -> str:
    label = f"#{stream['index']}" + (f" {stream['group']}" if stream["group"] != "main" else "")
    return label + (" (preempted)" if stream.get("stats") and stream["stats"].get("is_preempted") else "")
