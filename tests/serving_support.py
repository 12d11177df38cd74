"""Helpers for the serving tests: a model folder, a real `gmlx serve` process, free ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN_TARGET = REPO_ROOT / "gmlx" / "models" / "builtin" / "target"
_TINY_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"gmlx-serving-tiny-{os.getuid()}"


def drafter_for(folder: Path) -> str:
    """The MTP head where one ships for the model, else the model-free n-gram drafter."""
    has_mtp = (BUILTIN_TARGET.parent / "mtp" / "model.safetensors").exists()
    return "mtp" if folder == BUILTIN_TARGET and has_mtp else "ngram"


def model_dir() -> Path:
    """The built-in model once it ships; until then a tiny random qwen3 with its own BPE."""
    if (BUILTIN_TARGET / "config.json").exists() and (BUILTIN_TARGET / "model.safetensors").exists():
        return BUILTIN_TARGET
    if not (_TINY_DIR / "model.safetensors").exists():
        _make_tiny_model(_TINY_DIR)
    return _TINY_DIR


def _make_tiny_model(folder: Path) -> None:
    import gmlx  # noqa: F401  (BLAS before mlx)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import email.message as corpus_module

    tmp = folder.with_name(folder.name + f".{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([corpus_module.__file__], trainer)
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    config = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=512,
                  max_position_embeddings=1024, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0,
                  eos_token_id=tokenizer.token_to_id("<|endoftext|>"))
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(config))
    if not folder.exists():  # another test process may have won the race
        os.replace(tmp, folder)


def _die_with_parent() -> None:
    """SIGTERM the server if the test process dies (a hard timeout), so none is left behind."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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
                                     stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
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

    def worker_pids(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
                if "workers.worker" in " ".join(c.cmdline())]

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
