"""Starting and stopping the server processes a benchmark talks to, all on loopback.

Each process writes stdout and stderr to a log file in the run's work folder (no pipes to
fill up); readiness is a line in that log (`gmlx serve`) or an HTTP health check (mlx-lm).
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from workers.parent_death import die_with_parent

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment plus `extra`, with the repository importable (an uninstalled checkout)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env.setdefault("GMLX_LOG_LEVEL", "WARNING")
    return env


class ServerExitedError(RuntimeError):
    """A child that exited while starting; returncode < 0: killed by that signal."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


class ServerProcess:
    """One child process; `is_ready()` decides when it serves."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, is_ready,
                 start_timeout_s: float = 180.0):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.is_ready = is_ready
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self, num_attempts: int = 2) -> None:
        """Start and wait until ready; one retry, since a shared machine can fail a start (a package
        being reinstalled, a port taken between picking and binding)."""
        for attempt in range(1, num_attempts + 1):
            try:
                return self._start_once()
            except RuntimeError as exc:
                if attempt == num_attempts:
                    raise
                logger.warning("%s failed to start (attempt %d), retrying: %s", self.name, attempt,
                               str(exc).splitlines()[0])

    def _start_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        logger.info("starting %s: %s", self.name, " ".join(self.argv))
        # A bench killed mid-run (SIGTERM skips its finally) takes its servers with it.
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=str(REPO_ROOT), preexec_fn=die_with_parent)
        log.close()
        deadline_s = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline_s:
            if self.proc.poll() is not None:
                raise ServerExitedError(f"{self.name} exited with {self.proc.returncode} while starting:\n"
                                        f"{self.log_tail()}", self.proc.returncode)
            if self.is_ready(self):
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready within {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit after SIGTERM; killing it", self.name)
            self.proc.kill()
            self.proc.wait(5.0)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])


def is_gmlx_ready(server: ServerProcess) -> bool:
    return any("ready" in line for line in server.log_text().splitlines())


def make_health_check(port: int):
    def is_ready(server: ServerProcess) -> bool:
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=2.0)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    return is_ready


def start_http_server(name: str, argv: list[str], port: int, log_path: Path) -> ServerProcess:
    """A loopback HTTP server child (mlx_lm.server, llama-server), started and answering /health."""
    server = ServerProcess(name, argv, child_env({}), log_path, make_health_check(port))
    server.start()
    return server


def gmlx_serve_argv(address: str, drafter: str | None, model: str | None) -> list[str]:
    """`gmlx serve` on `address`; drafter None leaves gmlx serve its own default."""
    argv = [sys.executable, "-c", "from workers.cli import main; main()", "serve", "--address", address]
    argv += ["--drafter", drafter] if drafter else []
    return argv + (["--model", str(model)] if model else [])


def mlx_lm_server_argv(port: int, model: Path, draft: Path | None, num_draft_tokens: int | None,
                       blas: str) -> list[str]:
    # "same" runs mlx_lm.server's own main() after gmlx has loaded the BLAS it uses itself;
    # "bundled" runs it exactly as installed (the BLAS inside the mlx wheel).
    module = "workers.bench.mlx_lm_launch" if blas == "same" else "mlx_lm.server"
    argv = [sys.executable, "-m", module, "--model", str(model), "--host", LOOPBACK, "--port", str(port),
            "--log-level", "WARNING"]
    if draft is not None:
        argv += ["--draft-model", str(draft), "--num-draft-tokens", str(num_draft_tokens or 3)]
    return argv
