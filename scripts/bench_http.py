"""The HTTP gateway's added cost: N concurrent streaming clients over HTTP (SSE through the
gateway) against the same N over ZeroMQ (ipc.client.AsyncClient), side by side on one
`gmlx serve --http-port` process, rounds alternating so drift hits both alike.

    python3 scripts/bench_http.py --concurrency 8 --rounds 3 --max-tokens 64
    python3 scripts/bench_http.py --model inert      # the inert-grown built-in model (bench_models.py)

Reports aggregate tok/s per transport (tokens / wall time of a round, summed over rounds),
their ratio, p95 time to first token (send -> first chunk with text) of each, and the CPU
time each server process spent per token (psutil): on a busy machine throughput swings
between rounds, while the gateway's CPU per token is its cost measured directly.
The HTTP side uses a bare asyncio HTTP/1.1 reader, so what it adds over ZeroMQ is the
gateway's cost, not a client library's; each load client keeps one connection (a DEALER
socket, a kept-alive HTTP connection) for all its requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import psutil  # noqa: E402

from ipc.client import AsyncClient  # noqa: E402
from serving_support import Server, free_port  # noqa: E402

PROMPTS = ("def parse_args(argv):", "class Node:\n    def __init__(self", "import os\nimport sys\n\n",
           "def read_config(path):\n    with open(", "for i, line in enumerate(", "    def __repr__(self):",
           "if __name__ == '__main__':", "try:\n    import json\nexcept")


class ZmqTransport:
    """Streamed requests over ZeroMQ, one AsyncClient (one DEALER socket) per load client."""

    def __init__(self, address: str, max_tokens: int):
        self.address, self.max_tokens = address, max_tokens

    async def open(self):
        client = AsyncClient(self.address, timeout_s=120)

        async def request(prompt: str) -> tuple[float, int, str]:
            start_s, ttft_s, num_tokens, texts = time.perf_counter(), None, 0, []
            async for chunk in client.generate(prompt, max_tokens=self.max_tokens, temperature=0.0):
                if ttft_s is None and chunk.text:
                    ttft_s = time.perf_counter() - start_s
                num_tokens += len(chunk.token_ids)
                texts.append(chunk.text)
            return ttft_s, num_tokens, "".join(texts)

        return request, client.close


class HttpTransport:
    """The same over HTTP: POST /v1/completions with stream on one kept-alive connection per
    load client, the SSE events read as they come."""

    def __init__(self, port: int, model: str, max_tokens: int):
        self.port, self.model, self.max_tokens = port, model, max_tokens

    async def open(self):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def request(prompt: str) -> tuple[float, int, str]:
            body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                               "temperature": 0, "stream": True}).encode()
            start_s = time.perf_counter()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            status = await reader.readline()
            assert b" 200 " in status, status
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # headers: uvicorn streams with chunked transfer encoding
            ttft_s, texts, num_tokens, pending = None, [], 0, b""
            while True:
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    await reader.readline()  # the blank line after the last chunk
                    break
                pending += await reader.readexactly(size)
                await reader.readexactly(2)
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    data = event[len(b"data: "):]
                    if data == b"[DONE]":
                        continue
                    obj = json.loads(data)
                    text = obj["choices"][0]["text"]
                    if ttft_s is None and text:
                        ttft_s = time.perf_counter() - start_s
                    texts.append(text)
                    if obj.get("usage"):
                        num_tokens = obj["usage"]["completion_tokens"]
            return ttft_s, num_tokens, "".join(texts)

        return request, writer.close


async def run_round(transport, concurrency: int, requests_per_client: int):
    """Closed loop: each client opens its connection, then sends its requests back to back.
    `transport` serves all clients, or is a list of them, one per client (the mixed rounds).
    Results: (prompt, ttft_s, num_tokens, text, duration_s) per request."""
    transports = transport if isinstance(transport, list) else [transport] * concurrency

    async def one_client(i: int):
        request, close = await transports[i].open()
        results = []
        try:
            for j in range(requests_per_client):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                start_s = time.perf_counter()
                ttft_s, num_tokens, text = await request(prompt)
                results.append((prompt, ttft_s, num_tokens, text, time.perf_counter() - start_s))
        finally:
            close()
        return results

    start_s = time.perf_counter()
    per_client = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    wall_s = time.perf_counter() - start_s
    return wall_s, [r for results in per_client for r in results]


def server_processes(server: Server) -> dict[str, list[psutil.Process]]:
    root = psutil.Process(server.proc.pid)
    roles: dict[str, list[psutil.Process]] = {"frontend": [root], "worker": [], "gateway": []}
    for child in root.children(recursive=True):
        cmdline = " ".join(child.cmdline())
        role = "gateway" if "http_gateway" in cmdline else "worker" if "workers.worker" in cmdline else "frontend"
        roles[role].append(child)
    return roles


def cpu_s(roles: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds of each role's processes (and of this client process)."""
    out = {role: sum(sum(p.cpu_times()[:2]) for p in procs) for role, procs in roles.items()}
    out["client"] = sum(os.times()[:2])
    return out


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per transport, alternating")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mixed-rounds", type=int, default=2,
                        help="then rounds with half the clients on each transport at once")
    parser.add_argument("--drafter", default="mtp")
    parser.add_argument("--model", choices=("builtin", "inert"), default="builtin",
                        help="inert: the built-in target grown with inert parameters, so a token costs the "
                             "worker what a larger model's would (labelled inert-grown, not a trained model)")
    parser.add_argument("--inert-intermediate", type=int, default=4096)
    parser.add_argument("--inert-extra-layers", type=int, default=6)
    parser.add_argument("--inert-dir", default="/tmp/gmlx-bench-inert")
    args = parser.parse_args()

    model_folder, model = None, "gmlx-builtin"
    if args.model == "inert":
        from bench_models import grow_inert

        model_folder = grow_inert(Path(args.inert_dir) / f"inert-grown-{args.inert_intermediate}-"
                                  f"{args.inert_extra_layers}", args.inert_intermediate, args.inert_extra_layers)
        model = model_folder.name
        if args.drafter == "mtp":  # the built-in head reads hidden states the inert parameters leave unchanged
            from gmlx.config import BUILTIN_MTP_DIR

            args.drafter = f"mtp:{BUILTIN_MTP_DIR}"
    port = free_port()
    server = Server("--http-port", str(port), drafter=args.drafter, model=model_folder)
    try:
        deadline_s = time.monotonic() + 60
        while not any("http ready" in line for line in server.stdout_lines):
            assert time.monotonic() < deadline_s, server.log()
            time.sleep(0.1)
        transports = {"zmq": ZmqTransport(server.address, args.max_tokens),
                      "http": HttpTransport(port, model, args.max_tokens)}
        asyncio.run(run_round(transports["zmq"], args.concurrency, 1))  # warm-up: compile, caches
        asyncio.run(run_round(transports["http"], args.concurrency, 1))
        roles = server_processes(server)
        totals = {name: {"wall_s": 0.0, "tokens": 0, "ttft_s": [], "cpu_s": {}} for name in transports}
        texts: dict[str, set[str]] = {}  # prompt -> every text it got, over both transports
        for round_index in range(args.rounds):
            order = ("zmq", "http") if round_index % 2 == 0 else ("http", "zmq")
            for name in order:
                cpu_before = cpu_s(roles)
                wall_s, results = asyncio.run(run_round(transports[name], args.concurrency,
                                                        args.requests_per_client))
                total = totals[name]
                for role, seconds in cpu_s(roles).items():
                    total["cpu_s"][role] = total["cpu_s"].get(role, 0.0) + seconds - cpu_before[role]
                total["wall_s"] += wall_s
                total["tokens"] += sum(r[2] for r in results)
                total["ttft_s"] += [r[1] for r in results]
                for prompt, _, _, text, _ in results:
                    texts.setdefault(prompt, set()).add(text)
                print(f"round {round_index} {name}: {sum(r[2] for r in results) / wall_s:.1f} tok/s", flush=True)
        report = {name: {"tok_per_s": t["tokens"] / t["wall_s"], "p95_ttft_ms": 1000 * p95(t["ttft_s"]),
                         "median_ttft_ms": 1000 * statistics.median(t["ttft_s"]), "num_requests": len(t["ttft_s"]),
                         "cpu_ms_per_token": {role: round(1000 * s / t["tokens"], 4) for role, s in t["cpu_s"].items()}}
                  for name, t in totals.items()}
        report["mixed"] = mixed_rounds(transports, args, texts)
    finally:
        server.terminate()
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    print(json.dumps({"cpu": cpu, "model": model, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "drafter": args.drafter, **report,
                      "is_text_equal": all(len(v) == 1 for v in texts.values()),  # greedy: one text per prompt
                      "tok_per_s_ratio_http_over_zmq": report["http"]["tok_per_s"] / report["zmq"]["tok_per_s"],
                      "p95_ttft_diff_ms": report["http"]["p95_ttft_ms"] - report["zmq"]["p95_ttft_ms"],
                      "gateway_cpu_share": gateway_share(report["http"]["cpu_ms_per_token"])}, indent=1))


def mixed_rounds(transports: dict, args, texts: dict) -> dict:
    """Half the clients over ZeroMQ, half over HTTP, in the same rounds: both halves share one
    batch and one machine state, so their per-request numbers compare under identical load."""
    names = [("zmq", "http")[i % 2] for i in range(args.concurrency)]
    by_name = {name: [] for name in transports}
    for _ in range(args.mixed_rounds):
        _, results = asyncio.run(run_round([transports[n] for n in names], args.concurrency,
                                           args.requests_per_client))
        for i, result in enumerate(results):  # results come client by client
            by_name[names[i // args.requests_per_client]].append(result)
            texts.setdefault(result[0], set()).add(result[3])
    out = {name: {"request_tok_per_s": statistics.mean(r[2] / r[4] for r in rs),
                  "p95_ttft_ms": 1000 * p95([r[1] for r in rs]),
                  "median_ttft_ms": 1000 * statistics.median(r[1] for r in rs), "num_requests": len(rs)}
           for name, rs in by_name.items()}
    out["request_tok_per_s_ratio_http_over_zmq"] = out["http"]["request_tok_per_s"] / out["zmq"]["request_tok_per_s"]
    out["p95_ttft_diff_ms"] = out["http"]["p95_ttft_ms"] - out["zmq"]["p95_ttft_ms"]
    out["median_ttft_diff_ms"] = out["http"]["median_ttft_ms"] - out["zmq"]["median_ttft_ms"]
    return out


def gateway_share(cpu_ms: dict[str, float]) -> float:
    """The gateway's part of the server's CPU per token over HTTP (front-end + worker + gateway)."""
    return cpu_ms["gateway"] / (cpu_ms["gateway"] + cpu_ms["frontend"] + cpu_ms["worker"])


if __name__ == "__main__":
    main()
