"""A worker killed mid-stream on a real model: how long its client waits for the next token, and
whether the carried-over stream equals the uninterrupted one (workers/streams.py).

    python3 scripts/bench_carry_over.py --model smollm2 --workers 1,2 --repeats 3

Per repeat, one seeded sampled request runs twice on the same server: once whole, once with
the worker that holds it killed (SIGKILL) after --kill-after tokens. With 2 workers the stream
moves to the other at once; with 1 it waits for the restart (the model's load). The stall is
the longest gap between chunks after the kill, beside the stream's median gap a token.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ipc.client import Client  # noqa: E402
from serving_support import Server  # noqa: E402

PROMPTS = (  # chat turns that draw answers of a few hundred tokens
    "Explain in detail how a lighthouse keeper kept the lamp burning through a long winter storm.",
    "Write a Python function that merges two sorted lists, and explain each step of it carefully.",
    "Describe the water cycle to a ten-year-old in several paragraphs, with examples from daily life.",
)


def stream(client: Client, prompt: str, seed: int, args, kill_after: int | None = None,
           stats_client: Client | None = None):
    """(tokens, gaps between chunks a token, the stall: the longest gap after the kill, final stats).
    Chunks the dead worker sent before it died still arrive first, so the stall is the gap the
    client sees, not the time from the kill."""
    tokens, gaps_s, stall_s = [], [], None
    killed_at_s, last_s = None, time.monotonic()
    messages = [{"role": "user", "content": prompt}]
    for chunk in client.generate(messages=messages, max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=seed):
        now_s = time.monotonic()
        if killed_at_s is not None:
            stall_s = max(stall_s or 0.0, now_s - max(last_s, killed_at_s))
        elif tokens:
            gaps_s.append((now_s - last_s) / max(1, len(chunk.token_ids)))
        last_s = now_s
        tokens += chunk.token_ids
        if kill_after is not None and killed_at_s is None and len(tokens) >= kill_after:
            [holder] = [w["pid"] for w in stats_client.stats()["workers"] if w["num_active"] > 0]
            os.kill(holder, signal.SIGKILL)
            killed_at_s = time.monotonic()
    return tokens, gaps_s, stall_s, chunk.stats


def wait_for_workers(client: Client, num_workers: int, timeout_s: float = 300.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while client.stats()["num_workers"] < num_workers:
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"fewer than {num_workers} workers after {timeout_s:.0f} s")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kill-after", type=int, default=32, help="tokens streamed before the kill")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.kill_after < args.max_tokens:
        raise SystemExit(f"--kill-after: {args.kill_after} must be in (0, --max-tokens={args.max_tokens})")

    print("| workers | repeat | tokens | killed after | longest gap after the kill (s) | median gap a token (s) "
          "| equals the whole stream | worker losses |")
    print("|---|---|---|---|---|---|---|---|")
    for num_workers in (int(n) for n in args.workers.split(",")):
        server = Server(model=args.model, drafter=None, num_workers=num_workers)
        try:
            with Client(server.address, timeout_s=600) as client, Client(server.address, timeout_s=60) as stats:
                for repeat in range(args.repeats):
                    prompt, seed = PROMPTS[repeat % len(PROMPTS)], 1000 + repeat
                    whole, gaps_s, _, _ = stream(client, prompt, seed, args)
                    if len(whole) <= args.kill_after:
                        print(f"| {num_workers} | {repeat} | {len(whole)}: ended before the kill |", flush=True)
                        continue
                    wait_for_workers(stats, num_workers)
                    cut, _, stall_s, final = stream(client, prompt, seed, args, args.kill_after, stats)
                    wait_for_workers(stats, num_workers)
                    print(f"| {num_workers} | {repeat} | {len(cut)} | {args.kill_after} | {stall_s:.3f} "
                          f"| {statistics.median(gaps_s):.4f} | {cut == whole} | {final['num_worker_losses']} |",
                          flush=True)
            server.terminate()
        finally:
            if server.proc.poll() is None:
                server.kill()


if __name__ == "__main__":
    main()
