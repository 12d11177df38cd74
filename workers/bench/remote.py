"""Server targets: a `gmlx serve` process over ZeroMQ, and `mlx_lm.server` over HTTP.

One asyncio loop plays every client: closed loop as N client coroutines that each send
their next request when the last one finishes, open loop as one coroutine per request
that sends at its arrival time. gmlx streams through ipc.client.AsyncClient; mlx-lm
streams through blocking http.client calls on worker threads (no new dependency).
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workers.bench import model_files, servers
from workers.bench.metrics import StreamRecord, counter_delta
from workers.bench.targets import TargetSpec
from workers.bench.workload import RequestSpec, Workload

logger = logging.getLogger(__name__)

COALESCE_S = 0.001  # mlx-lm events closer than this belong to one decode round


async def drive(workload: Workload, send_one, progress, timeout_s: float) -> list[StreamRecord]:
    """Play the workload's clients; send_one(spec, record, now_s) streams one request."""
    start_s = time.perf_counter()
    records: list[StreamRecord] = []
    num_in_flight = 0

    def now_s() -> float:
        return time.perf_counter() - start_s

    async def one(spec: RequestSpec, arrival_s: float) -> None:
        nonlocal num_in_flight
        record = StreamRecord(spec.index, spec.group, spec.max_tokens, arrival_s)
        records.append(record)
        num_in_flight += 1
        progress.update(in_flight=num_in_flight)
        try:
            await send_one(spec, record, now_s)
        except Exception as exc:  # a failed request is a result, not the end of the run
            record.finish(now_s(), "error", f"{type(exc).__name__}: {exc}")
        finally:
            num_in_flight -= 1
            progress.update(done=1, in_flight=num_in_flight)

    specs = sorted(workload.requests, key=lambda s: (s.arrival_s or 0.0, s.index))
    if workload.is_open_loop:
        async def at_arrival(spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, spec.arrival_s - now_s()))
            await one(spec, spec.arrival_s)

        tasks = [asyncio.create_task(at_arrival(s)) for s in specs]
    else:
        queue = iter(specs)

        async def client() -> None:
            for spec in queue:  # shared: each client takes the next request when it is free
                await one(spec, now_s())

        tasks = [asyncio.create_task(client()) for _ in range(workload.concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.finish_s is None:
            record.finish(now_s(), "cancelled", "timeout")
    return records


def run_threaded(workload: Workload, stream, progress, timeout_s: float) -> list[StreamRecord]:
    """Play the workload with blocking HTTP streams on worker threads (one per client in flight).

    stream(spec, record, now_s, on_tokens) streams one request into its record.
    """
    async def play() -> list[StreamRecord]:
        loop = asyncio.get_running_loop()
        num_threads = min(256, workload.concurrency or len(workload.requests))
        with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="bench-http") as pool:
            def on_tokens(n: int) -> None:
                loop.call_soon_threadsafe(functools.partial(progress.update, tokens=n))

            async def send_one(spec: RequestSpec, record: StreamRecord, now_s) -> None:
                await loop.run_in_executor(pool, stream, spec, record, now_s, on_tokens)

            return await drive(workload, send_one, progress, timeout_s)

    return asyncio.run(play())


class GmlxServerTarget:
    def __init__(self, spec: TargetSpec, workdir: Path):
        self.spec = spec
        self.workdir = Path(workdir)
        self.address = spec.address
        self.server: servers.ServerProcess | None = None

    def start(self) -> None:
        _wait_for_client_library()
        if self.spec.address is not None:  # a server started elsewhere: used as it is
            return
        port = servers.free_port()
        self.address = f"tcp://{servers.LOOPBACK}:{port}"
        argv = servers.gmlx_serve_argv(self.address, self.spec.drafter, self.spec.model)
        env = servers.child_env(self.spec.gmlx_env())
        log_path = self.workdir / f"gmlx-serve-{port}.log"
        self.server = servers.ServerProcess(self.spec.name, argv, env, log_path, servers.is_gmlx_ready)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def describe(self) -> dict:
        return {**self.spec.describe(), "address": self.address, "format": model_files.gmlx_format(self.spec.model),
                "command": None if self.server is None else "gmlx " + _quote(self.server.argv[3:])}

    def run(self, workload: Workload, progress, timeout_s: float) -> dict:
        return asyncio.run(self._run(workload, progress, timeout_s))

    async def _run(self, workload: Workload, progress, timeout_s: float) -> dict:
        from ipc.client import AsyncClient  # gmlx/ itself never imports zmq

        client = AsyncClient(self.address, timeout_s=timeout_s)
        try:
            before = await client.stats()

            async def send_one(spec: RequestSpec, record: StreamRecord, now_s) -> None:
                async for chunk in client.generate(prompt=spec.prompt, max_tokens=spec.max_tokens,
                                                   temperature=workload.temperature, seed=spec.index,
                                                   ignore_eos=workload.is_ignore_eos):
                    time_s = now_s()
                    record.add_chunk(time_s, len(chunk.token_ids))
                    if chunk.emitted_at_ns:  # both CLOCK_MONOTONIC on this machine
                        record.transport_s.append((chunk.received_at_ns - chunk.emitted_at_ns) / 1e9)
                    progress.update(tokens=len(chunk.token_ids))
                    if chunk.finish_reason is not None:
                        record.finish(time_s, chunk.finish_reason)
                        record.stats = dict(chunk.stats or {})
                        record.prompt_tokens = record.stats.get("prompt_tokens")

            records = await drive(workload, send_one, progress, timeout_s)
            after = await client.stats()
        finally:
            client.close()
        return {"records": records, "counters": counter_delta(before, after), "events": [], "server_stats": after}


class MlxLmTarget:
    def __init__(self, spec: TargetSpec, workdir: Path):
        self.spec = spec
        self.workdir = Path(workdir)
        self.port: int | None = None
        self.server: servers.ServerProcess | None = None
        self.model_dir: Path | None = None
        self.draft_dir: Path | None = None
        self.formats: list[str] = []  # the target's, then the draft model's

    def start(self) -> None:
        from gmlx.config import BUILTIN_DRAFT_DIR
        from gmlx.drafters import parse_drafter

        kind, draft_path = parse_drafter(self.spec.drafter)
        self.formats = []  # a restart copies (finds) the same folders again
        self.model_dir = self._copy(model_files.mlx_lm_folder(self.spec.model))
        if kind == "draft":
            self.draft_dir = self._copy(model_files.mlx_lm_folder(draft_path or str(BUILTIN_DRAFT_DIR)))
        self.port = servers.free_port()
        argv = servers.mlx_lm_server_argv(self.port, self.model_dir, self.draft_dir, self.spec.num_draft_tokens,
                                          self.spec.blas)
        self.server = servers.start_http_server(self.spec.name, argv, self.port,
                                                self.workdir / f"mlx-lm-{self.port}.log")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _copy(self, folder: Path) -> Path:
        """The folder in the format asked for (auto: the one gmlx computes in here), float32 floats."""
        compute_format = self.spec.format
        if compute_format == "auto":
            compute_format = model_files.gmlx_compute_format(folder)
        elif compute_format == model_files.QUANTIZED and not model_files.is_quantized_folder(folder):
            raise ValueError(f"target {self.spec.name!r}: format=quantized, but {folder} is not quantized")
        self.formats.append(compute_format if model_files.is_quantized_folder(folder) else model_files.FLOAT32)
        return model_files.mlx_lm_copy(folder, compute_format)

    def describe(self) -> dict:
        formats = {model_files.FLOAT32: "float32 copy", model_files.QUANTIZED: "quantized copy, float32 scales"}
        return {**self.spec.describe(), "port": self.port, "model_copy": str(self.model_dir),
                "draft_copy": None if self.draft_dir is None else str(self.draft_dir),
                "format": f"{formats[self.formats[0]]} (MLX ops)" if self.formats else None,
                "draft_format": formats[self.formats[1]] if len(self.formats) > 1 else None,
                "command": None if self.server is None else "python " + _quote(self.server.argv[1:])}

    def run(self, workload: Workload, progress, timeout_s: float) -> dict:
        def stream(spec: RequestSpec, record: StreamRecord, now_s, on_tokens) -> None:
            self._stream(spec, record, now_s, workload.temperature, timeout_s, on_tokens)

        records = run_threaded(workload, stream, progress, timeout_s)
        return {"records": records, "counters": {}, "events": [], "server_stats": {}}

    def _stream(self, spec: RequestSpec, record: StreamRecord, now_s, temperature: float, timeout_s: float,
                on_tokens) -> None:
        # No seed: mlx_lm.server serves a seeded request alone, outside its batch.
        body = json.dumps({"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": temperature,
                           "stream": True, "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(servers.LOOPBACK, self.port, timeout=timeout_s)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read(500).decode(errors='replace')}")
            num_counted, finish_reason, usage = 0, None, None
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and ": keepalive" comments
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                time_s, msg = now_s(), json.loads(payload)
                usage = msg.get("usage") or usage
                for choice in msg.get("choices") or ():
                    if choice.get("text"):  # mlx-lm sends one event per token that has text
                        _add_token(record, time_s)
                        num_counted += 1
                        on_tokens(1)
                    finish_reason = choice.get("finish_reason") or finish_reason
        finally:
            conn.close()
        # Tokens whose text was held back (partial UTF-8) are not events of their own; the usage
        # count includes the EOS token of a "stop", which gmlx and llama-server do not output.
        num_tokens = usage.get("completion_tokens", num_counted) if usage else num_counted
        num_tokens -= bool(usage) and finish_reason == "stop"
        if record.chunk_tokens:
            record.set_num_tokens(num_tokens, record.chunk_times_s[-1])
        record.prompt_tokens = usage.get("prompt_tokens") if usage else None
        record.finish(now_s(), finish_reason or "stop")


def _add_token(record: StreamRecord, time_s: float) -> None:
    # A speculative round's tokens come as back-to-back events; merged into one chunk they
    # mean what one gmlx chunk (a round's tokens for a row) means, so ITL compares.
    if record.chunk_times_s and time_s - record.chunk_times_s[-1] < COALESCE_S:
        record.chunk_tokens[-1] += 1
    else:
        record.add_chunk(time_s, 1)


def _wait_for_client_library(timeout_s: float = 600.0) -> None:
    """ipc.client is written alongside this package; wait for it to import."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            from ipc.client import AsyncClient  # noqa: F401

            return
        except ImportError:
            if time.monotonic() > deadline_s:
                raise
            logger.warning("ipc.client is not importable yet; waiting")
            time.sleep(10.0)


def _quote(argv: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
