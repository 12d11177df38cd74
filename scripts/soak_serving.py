"""Soak a live `gmlx serve`: clients stream requests for a long time; report, per window,
front-end and worker RSS, p50/p99 time to first token, requests served, errors and
sequence gaps (a lost chunk fails its request in ipc.client, so gaps are counted there).

    python scripts/soak_serving.py                          # 30 minutes, 4 clients, built-in model
    python scripts/soak_serving.py --duration-s 60 --window-s 10   # a short run (CI)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO_ROOT), str(_REPO_ROOT / "scripts")]

import psutil  # noqa: E402

from ipc.client import Client, RequestError  # noqa: E402
from serving_support import Server, model_dir  # noqa: E402


class Tally:
    """What the client threads saw in the current window (swapped out by the reporter)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft_s: list[float] = []
        self.num_served = self.num_errors = self.num_gaps = 0

    def swap(self) -> "Tally":
        with self.lock:
            old = Tally()
            old.ttft_s, self.ttft_s = self.ttft_s, []
            old.num_served, old.num_errors, old.num_gaps = self.num_served, self.num_errors, self.num_gaps
            self.num_served = self.num_errors = self.num_gaps = 0
        return old


def client_loop(address: str, seed: int, tally: Tally, stop: threading.Event, vocab_size: int) -> None:
    rng = random.Random(seed)
    with Client(address, timeout_s=120) as client:
        while not stop.is_set():
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(4, 200))]
            start_s = time.monotonic()
            first_s = None
            try:
                for _ in client.generate(token_ids=prompt, max_tokens=rng.randint(8, 96),
                                         temperature=rng.choice([0.0, 0.8]), seed=rng.getrandbits(32)):
                    first_s = first_s or time.monotonic()
                with tally.lock:
                    tally.num_served += 1
                    tally.ttft_s.append(first_s - start_s)
            except (RequestError, TimeoutError) as e:
                with tally.lock:
                    tally.num_errors += 1
                    tally.num_gaps += "was lost" in str(e)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn below this")
    args = parser.parse_args()

    server = Server(model=model_dir(), drafter=args.drafter)
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(server.address, i, tally, stop, args.vocab_size),
                                daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    print("| minute | front-end RSS MB | workers RSS MB | served | errors | gaps | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    start_s = time.monotonic()
    first_rss = last_rss = None
    totals = {"served": 0, "errors": 0, "gaps": 0}
    try:
        while time.monotonic() - start_s < args.duration_s:
            time.sleep(min(args.window_s, max(0.0, args.duration_s - (time.monotonic() - start_s))))
            window = tally.swap()
            frontend_mb, workers_mb = rss_mb([server.first_frontend_pid]), rss_mb(server.worker_pids())
            first_rss = first_rss or (frontend_mb, workers_mb)
            last_rss = (frontend_mb, workers_mb)
            ttft = sorted(window.ttft_s) or [float("nan")]
            p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
            print(f"| {(time.monotonic() - start_s) / 60:.1f} | {frontend_mb:.0f} | {workers_mb:.0f} | "
                  f"{window.num_served} | {window.num_errors} | {window.num_gaps} | "
                  f"{statistics.median(ttft) * 1000:.0f} | {p99 * 1000:.0f} |", flush=True)
            totals["served"] += window.num_served
            totals["errors"] += window.num_errors
            totals["gaps"] += window.num_gaps
    finally:
        stop.set()
        for thread in threads:
            thread.join(150)
        code = server.terminate()
    drift = [100.0 * (b - a) / a for a, b in zip(first_rss, last_rss)]
    print(f"\n{totals['served']} served, {totals['errors']} errors, {totals['gaps']} sequence gaps; "
          f"RSS drift first -> last window: front-end {drift[0]:+.1f}%, workers {drift[1]:+.1f}%; "
          f"server exit code {code}")
    return 0 if totals["errors"] == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
