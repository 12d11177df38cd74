"""Helpers for the serving tests: a model folder, a real `gmlx serve` process, free ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from workers.parent_death import die_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN_TARGET = REPO_ROOT / "gmlx" / "models" / "builtin" / "target"


def drafter_for(folder: Path) -> str:
    """The MTP head where one ships for the model, else the model-free n-gram drafter."""
    has_mtp = (BUILTIN_TARGET.parent / "mtp" / "model.safetensors").exists()
    return "mtp" if folder == BUILTIN_TARGET and has_mtp else "ngram"


def model_dir() -> Path:
    """The built-in model: the serving tests' target."""
    return BUILTIN_TARGET


# The built-in model is a code model without a chat template: chat tests serve a copy with this one.
CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant\n{% endif %}")


def make_chat_model_dir(folder: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A copy of the built-in model at `folder` whose tokenizer has `chat_template`."""
    shutil.copytree(BUILTIN_TARGET, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config))
    return folder


def repo_env() -> dict:
    """The environment for a child process that imports this checkout's packages."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `gmlx serve` process (through workers.cli_serve) on a random free port."""

    def __init__(self, *args: str, model: Path | None = None, drafter: str | None = "ngram", num_workers: int = 1,
                 ready_timeout_s: float = 120.0, wait_ready: bool = True):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "workers.cli_serve", "--address", self.address,
               "--workers", str(num_workers), *args]
        if drafter is not None:
            cmd += ["--drafter", drafter]
        if model is not None and model != BUILTIN_TARGET:
            cmd += ["--model", str(model)]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=repo_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout_lines, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines, False), daemon=True).start()
        if wait_ready:
            self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log()}")
        self.first_frontend_pid = self.frontend_pid()

    def _pump(self, pipe, lines: list[str], is_stdout: bool) -> None:
        for line in pipe:
            lines.append(line)
            if is_stdout and "ready" in line:
                self._ready.set()
        if is_stdout:
            self._ready.set()  # exited: let the waiter see it

    def log(self) -> str:
        return "".join(self.stdout_lines[-50:]) + "".join(self.stderr_lines[-80:])

    def wait_for_line(self, needle: str, timeout_s: float = 60.0) -> None:
        """Until a line of stdout holds needle (e.g. "http ready"); RuntimeError with the log if none does."""
        deadline_s = time.monotonic() + timeout_s
        while not any(needle in line for line in self.stdout_lines):
            if time.monotonic() > deadline_s or self.proc.poll() is not None:
                raise RuntimeError(f"no {needle!r} line in {timeout_s} s:\n{self.log()}")
            time.sleep(0.1)

    def worker_pids(self) -> list[int]:
        return self._child_pids("workers.worker")

    def gateway_pid(self) -> int | None:
        """The HTTP gateway (`--http-port`), or None while there is none (e.g. being restarted)."""
        pids = self._child_pids("workers.http_gateway")
        assert len(pids) <= 1, pids
        return pids[0] if pids else None

    def _child_pids(self, module: str) -> list[int]:
        import psutil

        pids = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if module in " ".join(child.cmdline()):
                    pids.append(child.pid)
            except psutil.Error:  # a killed child not yet reaped (a zombie), or gone since the listing
                pass
        return pids

    def frontend_pid(self) -> int:
        """The front-end process: the supervised child of `gmlx serve`."""
        import psutil

        children = [c for c in psutil.Process(self.proc.pid).children() if "--no-supervise" in c.cmdline()]
        assert len(children) == 1, children
        return children[0].pid

    def terminate(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.kill()
        for child in children:
            child.kill()
        self.proc.wait()


def solo(engine, token_ids, **params) -> tuple[list[int], str]:
    """(tokens, finish reason) of one request decoded alone in an in-process engine: the
    reference every served or batched stream must equal."""
    from gmlx.request import SamplingParams

    request_id = engine.add_request(list(token_ids), SamplingParams(**params))
    tokens, reason = [], None
    while reason is None:
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                reason = out.finish_reason
    return tokens, reason
