"""A worker on another host, played by a second network namespace.

Namespace A holds the front-end (worker link bound on a veth address, CURVE required), its
own local worker (shared-memory bus) and the clients (on A's loopback); namespace B holds a
`gmlx-worker --no-bus` that reaches A only over the veth pair, so its requests travel inline
in INJECT. Every stream is checked against solo plain decoding in this process.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from ipc import messages as m
from ipc.auth import WorkerCredential, make_keys, secure_worker_socket
from ipc.client import Client
from serving_support import REPO_ROOT, Server, free_port, model_dir, repo_env, solo

TEST_TIMEOUT_S = 240
FRONTEND_ADDRESS = "10.213.7.1"  # a private /30 of our own, only between our two namespaces
REMOTE_ADDRESS = "10.213.7.2"
CLIENT_PORT, WORKER_PORT = 5555, 5556  # fresh namespaces: every port is free
NUM_STREAMS = 12

# Runs in namespace A: the clients. Reads one JSON line of work, writes JSON event lines.
DRIVER = r'''
import json, sys, threading, time
from ipc.client import Client, RequestError

work = json.loads(sys.stdin.readline())
address = work["address"]

def emit(**event):
    print(json.dumps(event), flush=True)

with Client(address, timeout_s=30) as c:
    deadline_s = time.monotonic() + 120
    while c.stats()["num_workers"] < 2:
        assert time.monotonic() < deadline_s, "the remote worker never joined"
        time.sleep(0.2)
emit(event="workers")

def run_streams(max_tokens, started):
    results = [None] * len(work["prompts"])
    def one(i):
        tokens, reason, error = [], None, None
        try:
            with Client(address, timeout_s=60) as c:
                for chunk in c.generate(token_ids=work["prompts"][i], max_tokens=max_tokens, temperature=0.0):
                    tokens += chunk.token_ids
                    reason = chunk.finish_reason
                    started[i].set()
        except RequestError as e:
            error = str(e)
        started[i].set()
        results[i] = [tokens, reason, error]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    return threads, results

started = [threading.Event() for _ in work["prompts"]]
threads, results = run_streams(work["max_tokens"], started)
for t in threads:
    t.join()
emit(event="concurrent", results=results)

sys.stdin.readline()  # the test has checked the first phase: go on
started = [threading.Event() for _ in work["prompts"]]
threads, results = run_streams(work["long_max_tokens"], started)
for event in started:
    event.wait(60)
emit(event="streaming")  # the test kills the remote worker now
for t in threads:
    t.join()
emit(event="after_kill", results=results)
'''


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@pytest.fixture
def namespaces():
    """(A, B): two fresh namespaces joined by a veth pair; skips where they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (apt-get install iproute2)")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"gmlx-fe-{tag}", f"gmlx-rw-{tag}"
    made = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", f"gfe{tag}", "type", "veth", "peer", "name", f"grw{tag}")
        for ns, dev, addr in ((ns_a, f"gfe{tag}", FRONTEND_ADDRESS), (ns_b, f"grw{tag}", REMOTE_ADDRESS)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"cannot make network namespaces: {getattr(e, 'stderr', '') or e}")
    try:
        yield ns_a, ns_b
    finally:
        for ns in (ns_a, ns_b):  # whatever is left of our processes in them, then the namespaces
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)



@pytest.fixture(scope="module")
def plain_engine():
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    return Engine.load(EngineConfig(model_path=None, drafter="none"))


class Lines:
    """A child's output lines, read on a thread so a pipe never fills."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe):
        for line in pipe:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of output
            self._cond.notify_all()

    def wait_for(self, predicate, timeout_s: float) -> str:
        deadline_s = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if line is None:
                        raise AssertionError("the process ended first")
                    if predicate(line):
                        return line
                seen = len(self.lines)
                remaining_s = deadline_s - time.monotonic()
                assert remaining_s > 0, "timed out"
                self._cond.wait(remaining_s)

    def text(self) -> str:
        return "".join(line for line in self.lines if line is not None)[-6000:]


def _popen(ns: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], cwd=REPO_ROOT, env=repo_env(),
                            text=True, **kwargs)


@pytest.mark.slow  # ~45 s: two workers load the model and decode 24 streams on a shared 2-core box
def test_remote_worker_streams_equal_solo_and_go_on_locally_when_it_dies(namespaces, tmp_path,
                                                                                 code_prompts, plain_engine):
    ns_a, ns_b = namespaces
    keys = make_keys(tmp_path / "keys")
    prompts = [list(p) for p in code_prompts[:NUM_STREAMS]]
    max_tokens, long_max_tokens = 24, 800  # long: still streaming when the kill lands
    worker_address = f"tcp://{FRONTEND_ADDRESS}:{WORKER_PORT}"

    # Off loopback the worker link refuses to start without CURVE keys, naming the option.
    refused = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-m", "workers.cli_serve",
                              "--worker-address", worker_address, "--address", f"tcp://127.0.0.1:{CLIENT_PORT}"],
                             cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--worker-curve-dir" in refused.stderr, refused.stderr

    server = _popen(ns_a, "-m", "workers.cli_serve", "--address", f"tcp://127.0.0.1:{CLIENT_PORT}",
                    "--worker-address", worker_address, "--worker-curve-dir", str(keys), "--workers", "1",
                    "--drafter", "ngram", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server_out = Lines(server.stdout)
    remote = driver = None
    try:
        server_out.wait_for(lambda line: "gmlx serve ready" in line, 120)
        remote = _popen(ns_b, "-m", "workers.worker", "--connect", worker_address, "--curve-dir", str(keys),
                        "--no-bus", "--drafter", "ngram", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        remote_out = Lines(remote.stderr)
        driver = _popen(ns_a, "-c", DRIVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        driver_out = Lines(driver.stdout)
        driver.stdin.write(json.dumps({"address": f"tcp://127.0.0.1:{CLIENT_PORT}", "prompts": prompts,
                                       "max_tokens": max_tokens, "long_max_tokens": long_max_tokens}) + "\n")
        driver.stdin.flush()

        def event(name: str, timeout_s: float) -> dict:
            line = driver_out.wait_for(lambda line: f'"event": "{name}"' in line, timeout_s)
            return json.loads(line)

        event("workers", 120)
        assert "payloads inline: no bus" in server_out.text(), server_out.text()
        concurrent = event("concurrent", 120)["results"]
        for prompt, (tokens, reason, error) in zip(prompts, concurrent):
            assert error is None, error
            assert [tokens, reason] == list(solo(plain_engine, prompt, max_tokens=max_tokens))
        expected = [solo(plain_engine, prompt, max_tokens=long_max_tokens) for prompt in prompts]
        driver.stdin.write("go\n")
        driver.stdin.flush()

        event("streaming", 60)
        remote.kill()  # SIGKILL: no DEAD message, only heartbeat silence tells the front-end
        remote.wait(10)
        after = event("after_kill", 60)["results"]
        # The remote worker's streams are carried over to the local one and end as if it had lived.
        for (expected_tokens, expected_reason), (tokens, reason, error) in zip(expected, after):
            assert error is None, (error, server_out.text())
            assert [tokens, reason] == [expected_tokens, expected_reason]
        assert "sent nothing for" in server_out.text()
        assert re.search(r"[1-9]\d* requests carried over", server_out.text()), server_out.text()
        driver.wait(30)
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server_out.text()
    except BaseException:
        print("server:\n" + server_out.text())
        if remote is not None:
            print("remote worker:\n" + remote_out.text())
        raise
    finally:
        for proc in (driver, remote, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


# --- the same paths on loopback: no namespaces needed -------------------------------------


def test_a_worker_address_off_loopback_without_keys_is_refused():
    cmd = [sys.executable, "-m", "workers.cli_serve", "--address", f"tcp://127.0.0.1:{free_port()}",
           "--worker-address", f"tcp://0.0.0.0:{free_port()}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 2
    assert "--worker-curve-dir" in out.stderr and "gmlx keys" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("remote") / "keys")


@pytest.fixture(scope="module")
def curve_server(keys):
    """Worker link on every interface (CURVE), one local worker; a --no-bus worker joins by hand."""
    worker_port = free_port()
    srv = Server("--worker-address", f"tcp://0.0.0.0:{worker_port}", "--worker-curve-dir", str(keys),
                 model=model_dir(), drafter="none")
    srv.worker_address = f"tcp://127.0.0.1:{worker_port}"
    yield srv
    srv.kill()


def _hello() -> list[bytes]:
    return m.encode_msgpack(m.Hello(pid=os.getpid(), model_path=str(model_dir()), max_context_tokens=64,
                                    vocab_size=64, drafter="none"))


def test_only_the_worker_key_joins_the_worker_link(curve_server, keys, tmp_path):
    client_only = tmp_path / "client_only"  # a client's keys where a worker's are expected
    client_only.mkdir(mode=0o700)
    shutil.copy(keys / "server.key", client_only / "server.key")
    shutil.copy(keys / "client.key_secret", client_only / "worker.key_secret")
    for folder, is_welcome_expected in ((client_only, False), (keys, True)):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_worker_socket(sock, WorkerCredential.from_curve_dir(folder))
        sock.connect(curve_server.worker_address)
        sock.send_multipart(_hello())
        if is_welcome_expected:
            assert sock.poll(10_000), "a worker with the worker key got no WELCOME"
            welcome = m.decode_msgpack(sock.recv_multipart())
            assert isinstance(welcome, m.Welcome)
            assert welcome.pub_address.startswith("tcp://0.0.0.0:")  # the worker reaches it by the host it used
        else:
            assert not sock.poll(3000), "a client key was let in as a worker"
        sock.close()


def test_a_no_bus_worker_serves_inline_payloads_equal_to_solo(curve_server, keys, code_prompts, plain_engine):
    worker = subprocess.Popen([sys.executable, "-m", "workers.worker", "--connect", curve_server.worker_address,
                               "--curve-dir", str(keys), "--no-bus", "--drafter", "none"],
                              cwd=REPO_ROOT, env=repo_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(curve_server.address, timeout_s=60) as client:
            deadline_s = time.monotonic() + 120
            while client.stats()["num_workers"] < 2:
                assert time.monotonic() < deadline_s and worker.poll() is None, curve_server.log()
                time.sleep(0.2)
        assert "payloads inline: no bus" in curve_server.log()
        prompts = [list(p) for p in code_prompts[:6]]
        results: list = [None] * len(prompts)

        def one(i: int) -> None:
            with Client(curve_server.address, timeout_s=60) as c:
                chunks = list(c.generate(token_ids=prompts[i], max_tokens=48, temperature=0.0))
            results[i] = [sum((ch.token_ids for ch in chunks), []), chunks[-1].finish_reason]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        for prompt, result in zip(prompts, results):  # least loaded routing: half went inline
            assert result == list(solo(plain_engine, prompt, max_tokens=48))
    finally:
        worker.kill()
        worker.wait(10)
