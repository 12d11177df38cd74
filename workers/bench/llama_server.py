"""llama.cpp's `llama-server` as a benchmark target, fed the same workload as token ids.

The binary is the one scripts/build_llama_cpp.sh caches (.cache/llama.cpp/bin in the repository,
or $LLAMA_CPP_CACHE/bin, the script's own variable). It serves `-np N` slots of `ctx` tokens each,
batching them continuously, on as many threads as gmlx uses (every CPU this process may run on).
Prompts go to /completion as the token ids of the GGUF's own tokenizer as gmlx builds it, so the
three servers decode the same sequences. Like gmlx and mlx_lm.server (neither can ignore EOS),
it stops at the model's end-of-generation token, which is not counted as an output token.
Where llama-server dies by a signal at start with its weight repacking on (llama.cpp's default;
seen with its AMX layouts on a 2-core Sapphire Rapids-class VM, where llama-bench runs with it), the
target starts it again with --no-repack, logs so, and describe() says which ran (`repack`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from workers.bench import model_files, servers
from workers.bench.metrics import StreamRecord
from workers.bench.targets import TargetSpec
from workers.bench.workload import RequestSpec, Workload

logger = logging.getLogger(__name__)

BUILD_COMMAND = "bash scripts/build_llama_cpp.sh"
FINISH_REASONS = {"eos": "stop", "word": "stop", "limit": "length"}  # llama.cpp stop_type -> ours


def llama_cpp_bin_dir() -> Path:
    """Where scripts/build_llama_cpp.sh puts the binaries (relative LLAMA_CPP_CACHE: from the repository)."""
    cache = Path(os.environ.get("LLAMA_CPP_CACHE") or ".cache/llama.cpp").expanduser()
    return (cache if cache.is_absolute() else servers.REPO_ROOT / cache) / "bin"


def llama_server_binary() -> Path:
    """The llama-server binary; RuntimeError saying how to build it when it is missing."""
    path = llama_cpp_bin_dir() / "llama-server"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RuntimeError(f"llama-server target: {path} is missing; build it with `{BUILD_COMMAND}` "
                           f"(or point LLAMA_CPP_CACHE at a folder whose bin/ holds it)")
    return path


def num_cpu_threads() -> int:
    """The threads gmlx computes on: every CPU this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gguf_path(spec: TargetSpec) -> Path:
    """The GGUF a llama-server target serves: gguf=PATH, else the model's own GGUF."""
    path = Path(spec.gguf).expanduser().resolve() if spec.gguf else model_files.model_source(spec.model)
    if not model_files.is_gguf(path):
        raise ValueError(f"target {spec.name!r}: llama-server needs a GGUF; give --model FILE.gguf (or smollm2) "
                         f"or gguf=PATH, not {path}")
    if not path.is_file():
        raise ValueError(f"target {spec.name!r}: no such GGUF file {path}")
    return path


def llama_server_argv(binary: Path, gguf: Path, port: int, num_slots: int, slot_context_tokens: int,
                      num_threads: int, repack: bool | None = None) -> list[str]:
    repack_flag = [] if repack is None else ["--repack" if repack else "--no-repack"]
    return [str(binary), "-m", str(gguf), "--host", servers.LOOPBACK, "--port", str(port),
            "-np", str(num_slots), "-c", str(num_slots * slot_context_tokens),
            "-t", str(num_threads), "-tb", str(num_threads), "--no-webui", *repack_flag]


def completion_body(prompt_ids: list[int], spec: RequestSpec, workload: Workload) -> str:
    """llama-server's /completion body for one request: plain temperature sampling (top-k/top-p/
    min-p off) like gmlx's, temperature 0 greedy, EOS ignored where the workload asks (both
    servers then decode every request's whole max_tokens)."""
    return json.dumps({"prompt": prompt_ids, "n_predict": spec.max_tokens, "temperature": workload.temperature,
                       "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": spec.index, "stream": True,
                       "cache_prompt": True, "ignore_eos": workload.is_ignore_eos})


class LlamaServerTarget:
    def __init__(self, spec: TargetSpec, workdir: Path, default_num_slots: int):
        self.spec = spec
        self.workdir = Path(workdir)
        self.num_slots = spec.num_slots or default_num_slots
        self.num_threads = num_cpu_threads()
        self.port: int | None = None
        self.gguf: Path | None = None
        self.tokenizer = None
        self.server: servers.ServerProcess | None = None
        self.repack = spec.repack  # what the running server was given (None: llama.cpp's default)

    def start(self) -> None:
        from gmlx.models.gguf_tokenizer import load_gguf_tokenizer  # no mlx

        binary = llama_server_binary()
        self.gguf = gguf_path(self.spec)
        self.tokenizer = load_gguf_tokenizer(self.gguf)  # gmlx's tokenizer for this GGUF
        self.port = servers.free_port()
        try:
            self.server = self._start_server(binary, self.spec.repack)
        except servers.ServerExitedError as exc:
            if self.spec.repack is not None or exc.returncode >= 0:
                raise
            logger.warning("%s died by a signal at start with weight repacking on; starting it with --no-repack",
                           self.spec.name)
            self.repack = False
            self.server = self._start_server(binary, False)

    def _start_server(self, binary: Path, repack: bool | None) -> servers.ServerProcess:
        argv = llama_server_argv(binary, self.gguf, self.port, self.num_slots, self.spec.slot_context_tokens,
                                 self.num_threads, repack)
        log_path = self.workdir / f"llama-server-{self.port}.log"
        return servers.start_http_server(self.spec.name, argv, self.port, log_path)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def describe(self) -> dict:
        return {**self.spec.describe(), "port": self.port, "gguf": None if self.gguf is None else str(self.gguf),
                "num_slots": self.num_slots, "num_threads": self.num_threads, "repack": self.repack,
                "format": None if self.gguf is None else f"GGUF {self.gguf.name} as stored (llama.cpp's kernels)",
                "command": None if self.server is None else " ".join(self.server.argv)}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def run(self, workload: Workload, progress, timeout_s: float) -> dict:
        from workers.bench.remote import run_threaded

        token_ids = {spec.index: self.encode(spec.prompt) for spec in workload.requests}

        def stream(spec: RequestSpec, record: StreamRecord, now_s, on_tokens) -> None:
            body = completion_body(token_ids[spec.index], spec, workload)
            self._stream(body, record, now_s, timeout_s, on_tokens)

        records = run_threaded(workload, stream, progress, timeout_s)
        return {"records": records, "counters": {}, "events": [], "server_stats": {}}

    def _stream(self, body: str, record: StreamRecord, now_s, timeout_s: float, on_tokens) -> None:
        import http.client

        conn = http.client.HTTPConnection(servers.LOOPBACK, self.port, timeout=timeout_s)
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read(500).decode(errors='replace')}")
            final = _read_events(response, record, now_s, on_tokens)
        finally:
            conn.close()
        if final is None:
            raise RuntimeError("the stream ended without a final event")
        # tokens_predicted counts the end-of-generation token; no other target counts it.
        num_tokens = final.get("tokens_predicted", record.num_tokens) - (final.get("stop_type") == "eos")
        record.set_num_tokens(num_tokens, now_s())
        record.prompt_tokens = final.get("tokens_evaluated")
        record.stats = {"stop_type": final.get("stop_type"), "tokens_cached": final.get("tokens_cached")}
        record.finish(now_s(), FINISH_REASONS.get(final.get("stop_type"), "stop"))


def _read_events(response, record: StreamRecord, now_s, on_tokens) -> dict | None:
    """Time-stamp each event's new tokens (by its running count); returns the final event."""
    num_counted = 0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        time_s, msg = now_s(), json.loads(payload)
        if "error" in msg:
            raise RuntimeError(f"llama-server: {msg['error']}")
        num_new = msg.get("tokens_predicted", num_counted) - num_counted
        if num_new > 0:
            record.add_chunk(time_s, num_new)
            num_counted += num_new
            on_tokens(num_new)
        if msg.get("stop"):
            return msg
    return None

