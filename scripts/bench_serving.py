"""What the serving path costs: tokens/s through front-end, bus and PUB vs the in-process engine.

Runs the same width-W workload (W concurrent greedy requests) alternately on an in-process
Engine and through a `gmlx serve` subprocess, side by side in one run, and reports the
throughput ratio plus the latency the path adds to each token: the time from the worker
publishing a round to the client holding its chunk (both clocks are CLOCK_MONOTONIC on this
host). Prints a markdown table, then one JSON object as the last line.

    python scripts/bench_serving.py [--model PATH] [--drafter none] [--width 8] [--max-tokens 128]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

from workers.bench.metrics import percentile  # noqa: E402  (interpolated, as the load generator's)


def make_prompts(tokenizer, width: int, prompt_tokens: int) -> list[list[int]]:
    ids = tokenizer.encode(Path(json.__file__).read_text())
    step = (len(ids) - prompt_tokens) // max(1, width)
    return [ids[i * step: i * step + prompt_tokens] for i in range(width)]


def run_in_process(engine, prompts, max_tokens: int) -> dict:
    from gmlx.request import SamplingParams

    start_s = time.perf_counter()
    ids = {engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts}
    num_tokens, first_token_s = 0, {}
    while ids:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.new_token_ids:
                first_token_s.setdefault(out.request_id, time.perf_counter() - start_s)
            if out.finish_reason is not None:
                ids.discard(out.request_id)
    wall_s = time.perf_counter() - start_s
    return {"tokens": num_tokens, "wall_s": wall_s, "ttft_s": list(first_token_s.values()), "added_ms": []}


async def _run_served(address: str, prompts, max_tokens: int) -> dict:
    from ipc.client import AsyncClient

    async with AsyncClient(address, timeout_s=120) as client:
        start_s = time.perf_counter()
        added_ms, ttft_s = [], []

        async def one(prompt):
            tokens = 0
            async for chunk in client.generate(token_ids=prompt, max_tokens=max_tokens):
                if chunk.token_ids and not tokens:
                    ttft_s.append(time.perf_counter() - start_s)
                tokens += len(chunk.token_ids)
                if chunk.emitted_at_ns is not None:
                    added_ms.extend([(chunk.received_at_ns - chunk.emitted_at_ns) / 1e6] * len(chunk.token_ids))
            return tokens

        counts = await asyncio.gather(*(one(p) for p in prompts))
        return {"tokens": sum(counts), "wall_s": time.perf_counter() - start_s, "ttft_s": ttft_s,
                "added_ms": added_ms}


def start_server(model: str | None, drafter: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    cmd = [sys.executable, "-m", "workers.cli_serve", "--address", address, "--drafter", drafter]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GMLX_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "ready" in line:
            return proc, address
    raise RuntimeError(f"gmlx serve exited with {proc.wait()} before it was ready")


@click.command()
@click.option("--model", default=None, help="Model folder (default: the built-in model).")
@click.option("--drafter", default="none", show_default=True)
@click.option("--width", default=8, show_default=True, help="Concurrent requests.")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--prompt-tokens", default=32, show_default=True)
@click.option("--trials", default=3, show_default=True, help="Timed trials per mode, interleaved.")
def main(model, drafter, width, max_tokens, prompt_tokens, trials) -> None:
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    engine = Engine.load(EngineConfig(model_path=model, drafter=drafter))
    prompts = make_prompts(engine.tokenizer, width, prompt_tokens)
    proc, address = start_server(model, drafter)
    try:
        run_in_process(engine, prompts, max_tokens)  # warm-up, untimed
        asyncio.run(_run_served(address, prompts, max_tokens))
        runs = {"in-process": [], "served": []}
        for _ in range(trials):  # interleaved, so drift on a shared machine hits both alike
            runs["in-process"].append(run_in_process(engine, prompts, max_tokens))
            runs["served"].append(asyncio.run(_run_served(address, prompts, max_tokens)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report = summarize(runs, engine.model_path, drafter, width, max_tokens, prompt_tokens)
    print(format_table(report))
    print(json.dumps(report))


def summarize(runs, model_path, drafter, width, max_tokens, prompt_tokens) -> dict:
    modes = {}
    for mode, trials in runs.items():
        rates = [t["tokens"] / t["wall_s"] for t in trials]
        ttft = [x for t in trials for x in t["ttft_s"]]
        added = [x for t in trials for x in t["added_ms"]]
        modes[mode] = {"tok_per_s": statistics.median(rates), "tok_per_s_trials": rates,
                       "tokens_per_trial": trials[0]["tokens"], "ttft_p50_s": percentile(ttft, 50),
                       "added_latency_p50_ms": percentile(added, 50), "added_latency_p99_ms": percentile(added, 99)}
    ratios = [s / i for s, i in zip(modes["served"]["tok_per_s_trials"], modes["in-process"]["tok_per_s_trials"])]
    return {"model": model_path, "drafter": drafter, "width": width, "max_tokens": max_tokens,
            "prompt_tokens": prompt_tokens, "modes": modes, "served_over_in_process": statistics.median(ratios),
            "ratio_trials": ratios}


def format_table(report: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [f"width {report['width']}, {report['max_tokens']} tokens each, drafter {report['drafter']}, "
             f"model {report['model']}", "",
             "| mode | tok/s (median) | ratio | TTFT p50 ms | added latency p50 ms | added latency p99 ms |",
             "|---|---|---|---|---|---|"]
    base = report["modes"]["in-process"]["tok_per_s"]
    for mode, row in report["modes"].items():
        ratio = report["served_over_in_process"] if mode == "served" else 1.0
        lines.append(f"| {mode} | {row['tok_per_s']:.0f} | {ratio:.3f} | {ms(row['ttft_p50_s'] * 1e3)} | "
                     f"{ms(row['added_latency_p50_ms'])} | {ms(row['added_latency_p99_ms'])} |")
    assert base > 0
    return "\n".join(lines)


if __name__ == "__main__":
    main()
