"""`gmlx serve` end to end: real processes on real sockets, the real engine, no stand-ins.

Every stream is checked against solo in-process decoding of the same request.
"""

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from ipc import messages as m
from ipc.bus import list_segments, parse_owner
from ipc.client import AsyncClient, Client, RequestError
from serving_support import BUILTIN_TARGET, REPO_ROOT, Server, drafter_for, free_port, model_dir, repo_env, solo

TEST_TIMEOUT_S = 150  # hard: a hung socket must fail the run, not stall it
CONTRACT_STAT_KEYS = ("num_requests", "num_active", "num_queued", "num_spec_rounds", "num_gated_rounds",
                      "num_capture_rounds", "num_preempts", "num_resumes", "num_drafted", "num_accepted",
                      "width_cap")



@pytest.fixture(scope="module")
def model_path() -> Path:
    return model_dir()


@pytest.fixture(scope="module")
def engine(model_path):
    """The in-process reference: same model and drafter as the server, one request at a time."""
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # the BLAS (and, unless switched off, the interposer) before mlx
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    path = None if model_path == BUILTIN_TARGET else str(model_path)
    return Engine.load(EngineConfig(model_path=path, drafter=drafter_for(model_path)))


@pytest.fixture(scope="module")
def server(model_path):
    # A cap of 4 lets 16 streams start gated and drain back within it while rows still have
    # budget left, so the run passes through gate, capture and resume.
    srv = Server("--speculative-width-cap", "4", model=model_path, drafter=drafter_for(model_path))
    yield srv
    assert srv.terminate() == 0, srv.log()
    assert not owned_segments(srv), "the bus outlived a clean shutdown"


def owned_segments(srv: Server) -> list[str]:
    return [name for name in list_segments() if parse_owner(name)[0] in (srv.proc.pid, srv.first_frontend_pid)]


def make_requests(tokenizer, num_requests: int, seed: int = 0) -> list[dict]:
    """Prompts cut from real source text, mixed lengths; even ones greedy, odd ones seeded at 0.8.

    Every fourth request is long, so that once the short ones finish the batch drains back
    within the width cap and speculation resumes mid-stream."""
    ids = tokenizer.encode(Path(json.__file__).read_text())
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        start = rng.randrange(len(ids) - 300)
        sampled = i % 2 == 1
        max_tokens = rng.randint(100, 160) if i % 4 == 0 else rng.randint(8, 64)
        requests.append(dict(token_ids=ids[start:start + rng.randint(2, 200)], max_tokens=max_tokens,
                             temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0,
                             seed=1000 + i))
    return requests


@contextlib.contextmanager
def processes_stopped(pids: list[int]):
    """SIGSTOP the processes for the block, SIGCONT after: a stream stays in flight however fast
    it decodes, and a 2 s heartbeat timeout outlasts a short block."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def collect(chunks) -> dict:
    chunks = list(chunks)
    return {"token_ids": [t for c in chunks for t in c.token_ids], "text": "".join(c.text for c in chunks),
            "seqs": [c.seq for c in chunks], "finish_reason": chunks[-1].finish_reason, "stats": chunks[-1].stats}


def test_concurrent_streams_equal_solo_decoding(server, engine):
    requests = make_requests(engine.tokenizer, 16)
    results: dict[int, dict] = {}
    errors = []

    def run_sync(i):
        try:
            with Client(server.address, timeout_s=60) as client:
                results[i] = collect(client.generate(**requests[i]))
        except Exception as e:  # reported below with the request that failed
            errors.append((i, e))

    async def run_async(indices):
        async with AsyncClient(server.address, timeout_s=60) as client:  # one socket, many streams
            async def one(i):
                results[i] = collect([c async for c in client.generate(**requests[i])])
            await asyncio.gather(*(one(i) for i in indices))

    threads = [threading.Thread(target=run_sync, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=lambda: asyncio.run(run_async(range(8, 16)))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results) == list(range(16))
    for i, request in enumerate(requests):
        got = results[i]
        assert got["seqs"] == list(range(len(got["seqs"]))), f"request {i}: stream not continuous"
        tokens, reason = solo(engine, **request)
        assert got["token_ids"] == tokens, f"request {i} ({request['temperature']=}) differs from solo decoding"
        assert got["finish_reason"] == reason
        assert got["text"] == engine.tokenizer.decode(tokens)
        assert got["stats"]["generated_tokens"] == len(tokens)
    with Client(server.address, timeout_s=30) as client:
        stats = client.stats()
    assert set(CONTRACT_STAT_KEYS) <= set(stats)
    assert stats["num_requests"] >= 16 and stats["num_drafted"] > 0
    if stats["width_cap"]:  # wider than the cap at first, within it at the end
        assert stats["num_gated_rounds"] > 0 and stats["num_resumes"] > 0


def test_stop_string_ends_the_stream_at_its_token(server, engine):
    prompt = make_requests(engine.tokenizer, 1, seed=5)[0]["token_ids"]
    tokens, _ = solo(engine, prompt, max_tokens=48)
    text = engine.tokenizer.decode(tokens)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    expected = next(n for n in range(1, len(tokens) + 1) if stop in engine.tokenizer.decode(tokens[:n]))
    with Client(server.address, timeout_s=30) as client:
        got = collect(client.generate(token_ids=prompt, max_tokens=48, stop=[stop]))
    assert got["finish_reason"] == "stop"
    assert got["text"] == text[:cut]
    assert got["token_ids"] == tokens[:expected]


def raw_socket(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def send_json(sock, tag: bytes, body) -> None:
    sock.send_multipart([tag, json.dumps(body).encode()])


BAD_REQUESTS = [  # (frames, the field the error must name)
    ([b"G"], None),
    ([b"G", b"{}", b"extra"], None),
    ([b"Q", b"{}"], "type"),
    ([b"A", b'{"ref": "x", "request_id": "r1", "prompt_tokens": 1, "model": "m"}'], "type"),
    ([b"G", b"{not json"], None),
    ([b"G", b'{"prompt": "def f("}'], "ref"),
    ([b"G", b'{"ref": "b1", "prompt": "x", "max_tokens": "12"}'], "max_tokens"),
    ([b"G", b'{"ref": "b2", "token_ids": [1, "a"]}'], "token_ids"),
    ([b"G", b'{"ref": "b3", "prompt": "x", "bogus": 1}'], "bogus"),
    ([b"G", b'{"ref": "b4", "prompt": "' + b"x" * (m.MAX_MESSAGE_BYTES + 10) + b'"}'], None),
    ([b"G", b'{"ref": "b5", "prompt": "x", "temperature": -1}'], "temperature"),
    ([b"G", b'{"ref": "b6", "prompt": "x", "top_p": 0}'], "top_p"),
    ([b"G", b'{"ref": "b7", "prompt": "x", "top_k": -1}'], "top_k"),
    ([b"G", b'{"ref": "b8", "prompt": "x", "max_tokens": 0}'], "max_tokens"),
    ([b"G", b'{"ref": "b9", "prompt": "x", "seed": -5}'], "seed"),
    ([b"G", b'{"ref": "b10", "prompt": "x", "min_p": 1.5}'], "min_p"),
    ([b"G", b'{"ref": "b11", "prompt": "x", "stop": [""]}'], "stop"),
    ([b"G", b'{"ref": "b12"}'], "prompt"),
    ([b"G", b'{"ref": "b13", "prompt": "x", "token_ids": [1]}'], "prompt"),
    ([b"G", b'{"ref": "b14", "prompt": ""}'], "prompt"),
    ([b"G", b'{"ref": "b15", "token_ids": [99999999]}'], "token_ids"),
    ([b"G", b'{"ref": "b16", "token_ids": []}'], "token_ids"),
    ([b"G", json.dumps({"ref": "b17", "token_ids": [1] * 40000}).encode()], "token_ids"),
    ([b"C", b"{}"], "request_id"),
    ([b"S", b'{"ref": 5}'], "ref"),
]


def test_bad_requests_are_answered_while_others_stream(server, engine):
    good = make_requests(engine.tokenizer, 1, seed=9)[0] | {"max_tokens": 64, "temperature": 0.0}
    sock = raw_socket(server.address)
    send_json(sock, b"G", {"ref": "good", **good})
    for frames, _ in BAD_REQUESTS:
        sock.send_multipart(frames)
    errors, chunks = [], []
    while not chunks or chunks[-1]["finish_reason"] is None or len(errors) < len(BAD_REQUESTS):
        tag, body = sock.recv_multipart()
        body = json.loads(body)
        if tag == b"E":
            assert body["request_id"] is None, body
            errors.append(body)
        elif tag == b"K":
            chunks.append(body)
        else:
            assert tag == b"A" and body["ref"] == "good"
    assert [e["field"] for e in errors] == [field for _, field in BAD_REQUESTS], errors
    refs = [json.loads(f[1]).get("ref") if f[0] == b"G" and len(f) == 2 and f[1].startswith(b'{"ref": "b') else None
            for f, _ in BAD_REQUESTS]
    assert [e["ref"] for e in errors if e["ref"]] == [r for r in refs if r and r != "b4"]
    assert all(e["message"] for e in errors)
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert [t for c in chunks for t in c["token_ids"]] == solo(engine, **good)[0]
    sock.close()


def test_cancel_mid_stream(server, engine):
    prompt = make_requests(engine.tokenizer, 1, seed=3)[0]["token_ids"]
    with Client(server.address, timeout_s=30) as client:
        num_cancelled = client.stats()["num_cancelled"]
        seen = []
        for chunk in client.generate(token_ids=prompt, max_tokens=800):
            seen.append(chunk)
            if len(seen) == 2:
                break  # leaving the loop cancels on the server
        deadline_s = time.monotonic() + 10
        while (stats := client.stats())["num_frontend_requests"] or stats["num_active"]:
            assert time.monotonic() < deadline_s, stats
            time.sleep(0.05)
        assert stats["num_cancelled"] == num_cancelled + 1

    async def break_out_async():
        async with AsyncClient(server.address, timeout_s=30) as client:
            num_chunks = 0
            async for _ in client.generate(token_ids=prompt, max_tokens=800):
                num_chunks += 1
                if num_chunks == 2:
                    break  # the abandoned generator's cleanup sends CANCEL
            deadline_s = time.monotonic() + 10
            while (stats := await client.stats())["num_frontend_requests"] or stats["num_active"]:
                assert time.monotonic() < deadline_s, stats
                await asyncio.sleep(0.05)
            assert stats["num_cancelled"] == num_cancelled + 2

    asyncio.run(break_out_async())

    # With plain pyzmq: CANCEL ends the stream with a final "cancelled" chunk.
    sock = raw_socket(server.address)
    send_json(sock, b"G", {"ref": "c", "token_ids": prompt, "max_tokens": 600})
    tag, body = sock.recv_multipart()
    request_id = json.loads(body)["request_id"]
    tag, body = sock.recv_multipart()
    assert tag == b"K"
    send_json(sock, b"C", {"request_id": request_id})
    chunks = [json.loads(body)]
    while chunks[-1]["finish_reason"] is None:
        chunks.append(json.loads(sock.recv_multipart()[1]))
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert sum(len(c["token_ids"]) for c in chunks) < 600
    sock.close()


def test_generate_cli_through_the_server(server, engine, model_path):
    cmd = [sys.executable, "-c", "from workers.cli import main; main()", "generate", "def parse(",
           "--server", server.address, "--max-tokens", "12", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    tokens, reason = solo(engine, engine.tokenizer.encode("def parse("), max_tokens=12)
    assert result["token_ids"] == tokens and result["finish_reason"] == reason
    assert Path(result["model"]) == Path(model_path)
    assert {"prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_per_s", "num_rounds", "num_drafted",
            "num_accepted"} <= set(result["stats"])


def test_generate_cli_logprobs_in_process_equal_the_servers(server, model_path):
    """`gmlx generate --logprobs 3 --logit-bias ... --stop-token-id ... --json`: the same tokens and
    logprobs, to the last bit, in process and through the server (speculating there), at a temperature."""
    args = ["generate", "def parse(", "--max-tokens", "12", "--temperature", "0.8", "--seed", "4",
            "--logprobs", "3", "--logit-bias", "7=3", "--logit-bias", "12=-100", "--stop-token-id", "13",
            "--min-tokens", "2", "--json"]
    results = []
    for where in (["--server", server.address], ["--model", str(model_path)]):
        cmd = [sys.executable, "-c", "from workers.cli import main; main()", *args, *where]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=repo_env(), cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    via_server, in_process = results
    assert [e["token_id"] for e in via_server["logprobs"]] == via_server["token_ids"]
    assert all(len(e["top_logprobs"]) == 3 for e in via_server["logprobs"])
    assert (via_server["token_ids"], via_server["logprobs"]) == (in_process["token_ids"], in_process["logprobs"])


def test_serve_rejects_bad_options():
    cmd = [sys.executable, "-m", "workers.cli_serve", "--model", "/nonexistent/model"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode != 0 and "--model" in out.stderr
    cmd = [sys.executable, "-m", "workers.cli_serve", "--drafter", "bogus"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode != 0 and "--drafter" in out.stderr


@pytest.mark.slow
def test_worker_kill_restart_and_drain(model_path, engine):
    """kill -9 one of two workers mid-stream, then SIGTERM the server mid-stream."""
    # Plain decoding (one token per round) keeps the streams alive until the kill; greedy
    # output does not depend on the drafter, so the reference engine (MTP or n-gram) applies.
    # The built-in model decodes 200 tokens in ~0.1 s, less than a slow client thread can take
    # to see its first chunk, so the streams run 800 (prompts are at most 200 of 1024 positions).
    num_stream_tokens = 800
    srv = Server(model=model_path, drafter="none", num_workers=2, wait_ready=False)
    try:
        streams = []  # four prompts whose greedy output runs the full length
        for request in make_requests(engine.tokenizer, 16, seed=11):
            tokens, reason = solo(engine, request["token_ids"], max_tokens=num_stream_tokens)
            if reason == "length":
                streams.append((request["token_ids"], tokens))
            if len(streams) == 4:
                break
        assert len(streams) == 4
        srv.wait_ready()
        prompt = streams[0][0]
        outcomes: dict[int, object] = {}
        started = threading.Barrier(5)

        def stream(i):
            try:
                with Client(srv.address, timeout_s=30) as client:
                    tokens = []
                    for chunk in client.generate(token_ids=streams[i][0], max_tokens=num_stream_tokens):
                        if not tokens:
                            started.wait(30)
                        tokens += chunk.token_ids
                    outcomes[i] = tokens
            except RequestError as e:
                outcomes[i] = (e, time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(30)  # all four streaming: two on each worker (least loaded)
        killed_at_s = time.monotonic()
        os.kill(srv.worker_pids()[0], signal.SIGKILL)
        for t in threads:
            t.join(60)
        # The killed worker's two streams were carried over to the other: all four end whole.
        assert {i: o for i, o in outcomes.items()} == {i: streams[i][1] for i in range(4)}, srv.log()
        assert "2 requests carried over" in srv.log() and time.monotonic() - killed_at_s < 30

        with Client(srv.address, timeout_s=60) as client:
            assert collect(client.generate(token_ids=prompt, max_tokens=8))["finish_reason"] == "length"
            deadline_s = time.monotonic() + 90
            while (stats := client.stats())["num_workers"] < 2:
                assert time.monotonic() < deadline_s, srv.log()
                time.sleep(0.2)
            assert stats["num_worker_restarts"] == 1

            # SIGTERM mid-stream: the stream finishes, new requests are refused, exit 0. The
            # workers are stopped meanwhile: plain decoding ends 900 tokens in ~0.3 s, and the
            # stream must still be in flight when the late request arrives.
            short_prompt = engine.tokenizer.encode("def main(")
            worker_pids = srv.worker_pids()
            chunks = client.generate(token_ids=short_prompt, max_tokens=900)
            first = next(chunks)
            with processes_stopped(worker_pids):
                srv.proc.send_signal(signal.SIGTERM)
                time.sleep(0.1)
                with Client(srv.address, timeout_s=10) as late, pytest.raises(RequestError, match="shutting down"):
                    next(late.generate(token_ids=prompt, max_tokens=4))
            rest = collect(chunks)
            assert rest["finish_reason"] == "length"
            assert first.token_ids + rest["token_ids"] == solo(engine, short_prompt, max_tokens=900)[0]
        assert srv.proc.wait(60) == 0, srv.log()
        assert not owned_segments(srv), "the bus outlived the server"
    finally:
        if srv.proc.poll() is None:
            srv.kill()


@pytest.mark.slow
def test_config_file_and_a_worker_started_by_hand(tmp_path, model_path, engine):
    config = tmp_path / "gmlx.toml"
    path_line = "" if model_path == BUILTIN_TARGET else f'path = "{model_path}"\n'
    config.write_text(f"[models.tiny]\n{path_line}drafter = \"ngram\"\nspeculative_width_cap = 2\n")
    worker_address = f"tcp://127.0.0.1:{free_port()}"
    # A drain far shorter than the long request below, whose workers are stopped through it.
    srv = Server("--config", str(config), "--worker-address", worker_address, "--drain-timeout-s", "0.05",
                 model=None, drafter=None)
    worker = None
    try:
        cmd = [sys.executable, "-m", "workers.worker", "--connect", worker_address, "--drafter", "ngram"]
        if model_path != BUILTIN_TARGET:
            cmd += ["--model", str(model_path)]
        worker = subprocess.Popen(cmd, env=repo_env(), cwd=REPO_ROOT)
        with Client(srv.address, timeout_s=60) as client:
            deadline_s = time.monotonic() + 90
            while (stats := client.stats())["num_workers"] < 2:
                assert time.monotonic() < deadline_s and worker.poll() is None, srv.log()
                time.sleep(0.2)
            by_id = {w["worker_id"]: w for w in stats["workers"]}
            assert by_id[1]["width_cap"] == 2 and by_id[1]["drafter"] == "ngram"  # spawned from the config
            assert by_id[1]["draft_depth"]["k_max"] > 0  # its depth policy's state, per worker
            assert sorted(w["pid"] for w in stats["workers"]) == sorted([*srv.worker_pids(), worker.pid])
            requests = make_requests(engine.tokenizer, 4, seed=21)
            streams = [client.generate(**r) for r in requests]
            results = [collect(s) for s in streams]  # one client, streams read one after another
            for request, got in zip(requests, results):
                assert got["token_ids"] == solo(engine, **request)[0]

            # Past the drain timeout an in-flight request gets an error; the server still exits 0.
            # The workers are stopped meanwhile, so the request is still in flight when it passes.
            worker_pids = [*srv.worker_pids(), worker.pid]
            chunks = client.generate(token_ids=engine.tokenizer.encode("def main("), max_tokens=900)
            next(chunks)
            with processes_stopped(worker_pids):
                srv.proc.send_signal(signal.SIGTERM)
                with pytest.raises(RequestError, match="shut down"):
                    collect(chunks)
        assert srv.proc.wait(60) == 0, srv.log()
        assert worker.wait(30) == 0  # SHUTDOWN reaches a worker started by hand too
    finally:
        for proc in (worker, srv.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
