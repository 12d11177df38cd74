"""`gmlx serve --http`: starts the HTTP gateway beside the front-end, restarts it if it dies,
and stops it after the front-end has drained."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from workers.parent_death import die_with_parent

logger = logging.getLogger(__name__)

_RESTART_DELAY_S = 1.0
_STOP_TIMEOUT_S = 10.0
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def connect_address(bound_address: str) -> str:
    """Where a local process connects to a front-end bound at `bound_address` (wildcards -> loopback)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if bound_address.startswith(wildcard):
            return "tcp://127.0.0.1:" + bound_address[len(wildcard):]
    return bound_address


class GatewayProcess:
    def __init__(self, http_url: str, host: str, port: int, model_path: str | None, api_key: str | None,
                 on_ready=None):
        self.http_url = http_url
        self._host, self._port = host, port
        self._model_path = model_path
        self._api_key = api_key
        self._on_ready = on_ready  # called once, when the port first accepts connections
        self._proc: subprocess.Popen | None = None
        self._is_stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.num_restarts = 0

    def start(self, server_address: str) -> None:
        self._server_address = connect_address(server_address)
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="http-gateway-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._is_stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the HTTP gateway ignored SIGTERM for %.0f s: killing it", _STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(_STOP_TIMEOUT_S)

    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "workers.http_gateway", "--server", self._server_address, "--http", self.http_url]
        if self._model_path is not None:
            cmd += ["--model", self._model_path]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        if self._api_key is not None:
            env["GMLX_HTTP_API_KEY"] = self._api_key  # in the environment, not argv: ps shows argv
        self._proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)

    def _watch(self) -> None:
        is_reported = False
        while not self._is_stopping.is_set():
            if not is_reported and self._accepts_connections():
                is_reported = True
                if self._on_ready is not None:
                    self._on_ready(self.http_url)
            code = self._proc.poll()
            if code is not None and not self._is_stopping.is_set():
                logger.error("the HTTP gateway exited with %s; restarting it", code)
                self.num_restarts += 1
                self._is_stopping.wait(_RESTART_DELAY_S)
                if not self._is_stopping.is_set():
                    self._spawn()
            self._is_stopping.wait(0.1)

    def _accepts_connections(self) -> bool:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else "::1" if self._host == "::" else self._host
        try:
            with socket.create_connection((host, self._port), timeout=0.2):
                return True
        except OSError:
            return False
