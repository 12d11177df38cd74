"""Fuzz a live `gmlx serve --http-port` gateway with named classes of HTTP requests (scripts/http_cases.py).

Each request goes on a fresh connection. Prints a table of class -> reply statuses and reply times,
and the totals that matter: server errors (5xx or no reply), valid requests not served, refusals
without OpenAI's error body, and gateway restarts (a gateway that died and was started again by
`gmlx serve`). After the run nothing may be left in flight (dropped streams are cancelled), and a
ZeroMQ client's request checks the server itself still serves.
The exit code is 1 if anything went wrong.

    python scripts/fuzz_http.py                          # 2,000 requests, the built-in model with a chat template
    python scripts/fuzz_http.py --num 20000 --seed 7 --clients 8   # eight connections at a time
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO_ROOT), str(_REPO_ROOT / "scripts")]  # this checkout's ipc/, not an installed one

import http_cases  # noqa: E402
from serving_support import Server, free_port, make_chat_model_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=2000, help="requests to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="stop early after this long")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--clients", type=int, default=1, help="connections in flight at once")
    parser.add_argument("--model", default=None, help="a model with a chat template (default: the built-in one with a "
                                                      "test template); smollm2 for the real one")
    args = parser.parse_args()

    statuses = collections.defaultdict(collections.Counter)
    reply_ms = collections.defaultdict(list)
    problems: list[str] = []
    lock, num_sent, start_s = threading.Lock(), 0, time.monotonic()

    def client(rng: random.Random, port: int, model_id: str) -> None:
        nonlocal num_sent
        while time.monotonic() - start_s < args.time_limit_s:
            with lock:
                if num_sent >= args.num:
                    return
                num_sent += 1
                number = num_sent
            case = http_cases.draw(rng, model_id)
            reply = http_cases.send("127.0.0.1", port, case)
            problem = http_cases.problem(case, reply)
            with lock:
                statuses[case.name][reply.status] += 1
                reply_ms[case.name].append(reply.elapsed_s * 1000)
                if problem:
                    problems.append(f"#{number} {case.name} {case.method} {case.path}: {problem} "
                                    f"(body {(case.body or b'')[:120]!r})")

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        model = args.model or make_chat_model_dir(Path(tmp) / "chat")
        server = Server("--http-port", str(port), model=model, drafter=args.drafter, ready_timeout_s=300)
        try:
            server.wait_for_line("http ready")
            model_id = _model_id(port)
            gateway_pid = server.gateway_pid()
            threads = [threading.Thread(target=client, args=(random.Random(args.seed * 1000 + i), port, model_id))
                       for i in range(args.clients)]
            for thread in threads:
                thread.start()
            rss = _watch_rss(server, threads, lambda: num_sent >= args.num // 10, lambda: num_sent * 10 // args.num)
            for thread in threads:
                thread.join()
            if server.gateway_pid() != gateway_pid or server.proc.poll() is not None:
                problems.append(f"the gateway or the server died or restarted\n{server.log()}")
            served_after = _zmq_serves(server)
        finally:
            server.kill()
    _print_table(statuses, reply_ms)
    num_valid = sum(sum(statuses[name].values()) for name in ("valid_completion", "valid_chat"))
    num_valid_served = sum(statuses[name][200] for name in ("valid_completion", "valid_chat"))
    print(f"\n{num_sent} requests in {time.monotonic() - start_s:.0f} s; problems: {len(problems)}; "
          f"valid requests served: {num_valid_served}/{num_valid}; ZeroMQ client served after: {served_after}")
    print("RSS MiB in each tenth of the requests: " + "; ".join(
        f"{name} " + " ".join(f"{by_tenth[t]:.0f}" for t in sorted(by_tenth)) for name, by_tenth in rss.items()))
    for line in problems[:20]:
        print("PROBLEM", line)
    return 1 if problems or not served_after else 0


def _watch_rss(server: Server, threads, is_warm, tenth, interval_s: float = 1.0) -> dict:
    """Each process kind's resident MiB (gateway, front-end, workers) while the clients run, the
    last reading in each tenth of the requests from the first warm one: {kind: {tenth: MiB}},
    filled in as they go. A cache grows to its budget and stays; a leak keeps growing."""
    from soak_serving import rss_mb

    readings: dict[str, dict[int, float]] = {}

    def watch() -> None:
        while any(t.is_alive() for t in threads):
            if is_warm():
                pids = {"gateway": [server.gateway_pid()], "front-end": [server.first_frontend_pid],
                        "workers": server.worker_pids()}
                for name, ids in pids.items():
                    readings.setdefault(name, {})[tenth()] = rss_mb([pid for pid in ids if pid is not None])
            time.sleep(interval_s)

    threading.Thread(target=watch, daemon=True).start()
    return readings


def _model_id(port: int) -> str:
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


def _zmq_serves(server: Server, timeout_s: float = 30.0) -> bool:
    """Nothing left in flight once the clients are done (dropped streams cancelled), and a
    ZeroMQ client's request served."""
    from ipc.client import Client

    with Client(server.address, timeout_s=60) as client:
        deadline_s = time.monotonic() + timeout_s
        while (stats := client.stats())["num_active"] or stats["num_queued"] or stats["num_frontend_requests"]:
            if time.monotonic() > deadline_s:
                print(f"still in flight {timeout_s} s after the last request: {stats}")
                return False
            time.sleep(0.1)
        return bool(list(client.generate(prompt="def main(", max_tokens=4)))


def _print_table(statuses, reply_ms) -> None:
    print("| class | requests | replies by status | reply ms p50 / max |")
    print("|---|---|---|---|")
    for name in http_cases.CLASSES:
        if not statuses[name]:
            continue
        counts = ", ".join(f"{status or 'none'}: {n}" for status, n in sorted(statuses[name].items(),
                                                                           key=lambda kv: kv[0] or 0))
        times = reply_ms[name]
        print(f"| {name} | {sum(statuses[name].values())} | {counts} | {statistics.median(times):.0f} / "
              f"{max(times):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
