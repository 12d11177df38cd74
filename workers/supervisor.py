"""The front-end's view of its workers: spawning, handshake state, health, restarts."""

from __future__ import annotations

import enum
import itertools
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.parent_death import die_with_parent

logger = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0)  # delay before the n-th consecutive restart
KILL_GRACE_S = 5.0  # after SHUTDOWN, how long a worker gets before SIGKILL


class WorkerState(enum.IntEnum):
    STARTING = 0  # spawned, engine loading; no HELLO yet
    WELCOMED = 1  # HELLO answered; waiting for READY over PUB
    READY = 2
    DEAD = 3


@dataclass(eq=False)
class WorkerHandle:
    worker_id: int
    proc: subprocess.Popen | None  # None for a worker started outside this front-end
    state: WorkerState = WorkerState.STARTING
    routing_id: bytes | None = None
    pid: int | None = None
    started_s: float = field(default_factory=time.monotonic)
    last_seen_s: float = field(default_factory=time.monotonic)
    request_ids: set[str] = field(default_factory=set)  # in flight on this worker
    slots: set[int] = field(default_factory=set)  # bus slots injected, not yet taken
    has_bus: bool = True  # from READY; False (another host): INJECT carries the payload inline

    @property
    def is_ready(self) -> bool:
        return self.state == WorkerState.READY

    @property
    def load(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start a local worker (the gmlx-worker command line)."""

    model_path: str | None = None
    drafter: str = "none"
    speculative_width_cap: int | None = None
    secret_file: str | None = None  # the worker link's shared secret (owner-only file)
    curve_dir: str | None = None  # instead of the secret: CURVE keys (a worker link off loopback)
    prefill_budget_ms: str | None = None  # "auto" or milliseconds; None = the engine's default (off)
    num_memory_sharers: int = 1  # workers started together on this host: each takes 1/N of the KV default

    def command(self, connect_address: str) -> list[str]:
        cmd = [sys.executable, "-m", "workers.worker", "--connect", connect_address, "--drafter", self.drafter]
        if self.curve_dir is not None:
            cmd += ["--curve-dir", self.curve_dir]
        elif self.secret_file is not None:
            cmd += ["--secret-file", self.secret_file]
        if self.prefill_budget_ms is not None:
            cmd += ["--prefill-budget-ms", self.prefill_budget_ms]
        if self.model_path is not None:
            cmd += ["--model", self.model_path]
        if self.speculative_width_cap is not None:
            cmd += ["--speculative-width-cap", str(self.speculative_width_cap)]
        if self.num_memory_sharers > 1:
            cmd += ["--memory-sharers", str(self.num_memory_sharers)]
        return cmd


class WorkerPool:
    def __init__(self, spec: WorkerSpec, connect_address: str, heartbeat_timeout_s: float,
                 startup_timeout_s: float):
        self.spec = spec
        self._connect_address = connect_address
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._ids = itertools.count(1)
        self.workers: dict[int, WorkerHandle] = {}
        self.num_restarts = 0
        self._num_failed_starts = 0  # consecutive deaths before READY
        self._restart_at_s: list[float] = []  # when to start replacements

    def spawn(self) -> WorkerHandle:
        # A new session keeps a terminal's Ctrl-C away from workers: the front-end drains first.
        env = dict(os.environ)
        # The worker imports this checkout's packages even when it is not pip-installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(self.spec.command(_local_address(self._connect_address)), start_new_session=True,
                                stdin=subprocess.DEVNULL, env=env)
        handle = WorkerHandle(next(self._ids), proc, pid=proc.pid)
        self.workers[handle.worker_id] = handle
        logger.info("started worker %d (pid %d)", handle.worker_id, proc.pid)
        return handle

    def on_hello(self, routing_id: bytes, pid: int) -> WorkerHandle:
        handle = next((w for w in self.workers.values() if w.pid == pid and w.state == WorkerState.STARTING), None)
        if handle is None:  # a gmlx-worker started by hand
            handle = WorkerHandle(next(self._ids), None, pid=pid)
            self.workers[handle.worker_id] = handle
        handle.routing_id = routing_id
        handle.state = WorkerState.WELCOMED
        handle.last_seen_s = time.monotonic()
        return handle

    def mark_ready(self, handle: WorkerHandle) -> None:
        handle.state = WorkerState.READY
        self._num_failed_starts = 0

    def ready_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.is_ready]

    def least_loaded(self) -> WorkerHandle | None:
        ready = self.ready_workers()
        return min(ready, key=lambda w: (w.load, w.worker_id)) if ready else None

    def find_dead(self) -> list[tuple[WorkerHandle, str]]:
        """Workers that exited, went silent, or never finished starting."""
        now_s = time.monotonic()
        dead = []
        for w in self.workers.values():
            code = w.proc.poll() if w.proc is not None else None
            if code is not None:
                dead.append((w, f"worker {w.worker_id} (pid {w.pid}) exited with code {code}"))
            elif w.state == WorkerState.READY and now_s - w.last_seen_s > self._heartbeat_timeout_s:
                dead.append((w, f"worker {w.worker_id} sent nothing for {self._heartbeat_timeout_s:.0f} s"))
            elif w.state < WorkerState.READY and now_s - w.started_s > self._startup_timeout_s:
                dead.append((w, f"worker {w.worker_id} did not start within {self._startup_timeout_s:.0f} s"))
        return dead

    def remove(self, handle: WorkerHandle, is_restarting: bool) -> None:
        """Forget a dead worker, killing what is left of it; schedule a replacement."""
        was_ready = handle.state == WorkerState.READY
        handle.state = WorkerState.DEAD
        self.workers.pop(handle.worker_id, None)
        if handle.proc is not None:
            if handle.proc.poll() is None:
                handle.proc.kill()
            handle.proc.wait()
            if is_restarting:
                self._num_failed_starts = 0 if was_ready else self._num_failed_starts + 1
                delay_s = RESTART_BACKOFF_S[min(self._num_failed_starts, len(RESTART_BACKOFF_S) - 1)]
                self._restart_at_s.append(time.monotonic() + delay_s)

    def restart_due(self) -> None:
        now_s = time.monotonic()
        due = [t for t in self._restart_at_s if t <= now_s]
        self._restart_at_s = [t for t in self._restart_at_s if t > now_s]
        for _ in due:
            self.num_restarts += 1
            self.spawn()

    def stop_all(self, send_shutdown) -> None:
        """Ask every worker to exit, then make sure each one does."""
        for w in self.workers.values():
            if w.routing_id is not None:
                send_shutdown(w)
            elif w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        deadline_s = time.monotonic() + KILL_GRACE_S
        for w in self.workers.values():
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("worker %d did not exit; killing it", w.worker_id)
                w.proc.kill()
                w.proc.wait()
        self.workers.clear()
        self._restart_at_s.clear()


def _local_address(worker_endpoint: str) -> str:
    """Where a worker on this host reaches a front-end bound at `worker_endpoint`."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if worker_endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + worker_endpoint[len(wildcard):]
    return worker_endpoint


EXIT_FRONTEND_FAILED = 70  # the front-end failed after it had been serving: restart it
FRONTEND_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # delay before the n-th restart in a row
FRONTEND_STABLE_S = 60.0  # a front-end up this long resets the backoff


def supervise_frontend(command: list[str]) -> int:
    """Run the front-end as a child and start it again whenever it dies while serving
    (killed by a signal, or a front-end failure); return its exit code otherwise.

    SIGTERM / SIGINT are passed on, and the child drains and exits as it would alone. The
    child's clients notice the death through their heartbeat (ipc/client.py) and reconnect
    to the new one at the same address; its workers notice within 2 s and exit."""
    import signal

    state = {"proc": None, "is_stopping": False}

    def forward(signum, _frame):
        state["is_stopping"] = True
        if state["proc"] is not None and state["proc"].poll() is None:
            state["proc"].send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    num_restarts = 0
    while True:
        started_s = time.monotonic()
        state["proc"] = subprocess.Popen(command, preexec_fn=die_with_parent)
        code = state["proc"].wait()
        if state["is_stopping"] or not (code < 0 or code == EXIT_FRONTEND_FAILED):
            return code if code >= 0 else 128 - code
        num_restarts = 0 if time.monotonic() - started_s > FRONTEND_STABLE_S else num_restarts + 1
        delay_s = FRONTEND_RESTART_BACKOFF_S[min(num_restarts, len(FRONTEND_RESTART_BACKOFF_S) - 1)]
        logger.error("the front-end (pid %d) died with code %d; starting it again in %.1f s",
                     state["proc"].pid, code, delay_s)
        time.sleep(delay_s)
        if state["is_stopping"]:
            return 0
