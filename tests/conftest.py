from gmlx.platform.blas import ensure_fast_blas

ensure_fast_blas()  # the fast BLAS (and its core choice) must come before mlx

import os  # noqa: E402

# Engines started by tests (and their child processes) keep the drafters' fixed width caps unless
# a test asks for the start-up calibration: measured costs on a shared box would make runs differ.
os.environ.setdefault("GMLX_CALIBRATE", "off")

import faulthandler
import json
import random
import signal
import sys
import threading
from pathlib import Path

import mlx.core as mx  # noqa: E402
import pytest

from gmlx.config import env_overrides
from gmlx.models import random_model
from gmlx.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # schedules, serving_support, frames: shared with scripts


# After a hard timeout's interrupt, how long the run gets to stop and report before it is ended.
HARD_TIMEOUT_GRACE_S = 60
# A run started in the background of a script inherits SIGINT ignored, and Python then keeps
# ignoring it: the hard timeout's interrupt would do nothing and the run would end a minute
# later with exit 1. The run takes SIGINT as pytest expects it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
_hard_timeout_stderr = []  # the terminal's stderr, kept open for the last-resort dump


def _on_hard_timeout(capture, nodeid: str, timeout_s: float) -> None:
    """Every thread's traceback on the terminal (pytest's capture would swallow it), then a
    KeyboardInterrupt in the main thread: pytest stops and prints its summary. Should the
    main thread never get back to Python, the run ends HARD_TIMEOUT_GRACE_S later, dumping again."""
    with capture.global_and_fixture_disabled():
        sys.stderr.write(f"\n{nodeid}: past its hard timeout of {timeout_s} s (TEST_TIMEOUT_S); "
                         "every thread's traceback:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _hard_timeout_stderr.append(os.fdopen(os.dup(sys.stderr.fileno()), "w"))
    faulthandler.dump_traceback_later(HARD_TIMEOUT_GRACE_S, exit=True, file=_hard_timeout_stderr[-1])
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # wakes a blocking call too


@pytest.fixture(autouse=True)
def hard_timeout(request):
    """A test file that talks to processes sets TEST_TIMEOUT_S: past it the run stops with the
    test's name and every thread's traceback, where a hung socket would otherwise stall it."""
    timeout_s = getattr(request.module, "TEST_TIMEOUT_S", None)
    if timeout_s is None:
        yield
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    timer = threading.Timer(timeout_s, _on_hard_timeout, args=(capture, request.node.nodeid, timeout_s))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def make_random_model_dir(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A small random-weight mlx-lm model folder with the built-in tokenizer."""
    return random_model.make_random_model_dir(folder, random_model.tiny_config(model_type, **overrides), seed)


@pytest.fixture(scope="session")
def mlx_lm_reference():
    """path -> the folder as mlx-lm alone loads it, float32 like gmlx on CPU but without
    gmlx's fused CPU ops: the independent side of every equality check. One load per path."""
    import mlx_lm

    models = {}

    def load(path: str):
        if path not in models:
            models[path], _ = mlx_lm.load(path)
            models[path].set_dtype(mx.float32)
        return models[path]

    return load


@pytest.fixture(scope="session")
def builtin_target():
    return load_model(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def blas_builtin_target():
    """The built-in model on the float32 BLAS path (float kernels off): graph fusion, input-major
    weights and the interposer, bit-identical to mlx-lm."""
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        return load_model(None)


@pytest.fixture(scope="session")
def blas_tiny_target(tiny_llama_dir):
    """The tiny llama on the float32 BLAS path, as blas_builtin_target."""
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        return load_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_quantized_target(tiny_llama_dir, tmp_path_factory):
    """The tiny llama quantized to 4 bits the way mlx-lm stores quantized folders."""
    import mlx_lm

    from kernel_support import load_quantized_copy

    model, _ = mlx_lm.load(str(tiny_llama_dir))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    return load_quantized_copy(model, config, tiny_llama_dir, tmp_path_factory.mktemp("tiny_llama_q4"))


def _gguf_like_copy(tmp_path_factory, name: str, model_type: str = "llama", seed: int = 0,
                    eight_bit_modules: tuple = ()):
    """A tiny random model with tied embeddings quantized as a GGUF arrives (kernel_support's
    load_quantized_copy, is_gguf_like), loaded with gmlx's defaults."""
    import mlx_lm

    from kernel_support import load_quantized_copy

    folder = make_random_model_dir(tmp_path_factory.mktemp(name), model_type, seed=seed, tie_word_embeddings=True)
    model, _ = mlx_lm.load(str(folder))
    config = json.loads((folder / "config.json").read_text())
    return load_quantized_copy(model, config, folder, tmp_path_factory.mktemp(f"{name}_gguf_like"),
                               is_gguf_like=True, eight_bit_modules=eight_bit_modules)


@pytest.fixture(scope="session")
def gguf_like_target(tmp_path_factory):
    """A tiny llama with tied embeddings, quantized as a Q4_1 GGUF arrives (4-bit layers with
    float16-exact scales, an 8-bit token table) and loaded with gmlx's defaults: int8
    activations, the one-stream quad layout, grouped q/k/v and gate/up products."""
    return _gguf_like_copy(tmp_path_factory, "tiny_llama_tied")


@pytest.fixture(scope="session")
def qwen2_gguf_like_target(tmp_path_factory):
    """gguf_like_target's quantization on a tiny qwen2 (Qwen 2.5's layout: q, k and v biases)."""
    return _gguf_like_copy(tmp_path_factory, "tiny_qwen2", "qwen2", seed=9)


@pytest.fixture(scope="session")
def kquant_like_target(tmp_path_factory):
    """gguf_like_target with 8-bit products among the 4-bit ones, each layer its own, as a
    Q4_K_M file arrives (Q4_K at 4 bits, its Q6_K and fallback Q5_0 tensors at 8)."""
    eight_bit = ("model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                 "model.layers.1.mlp.up_proj")
    return _gguf_like_copy(tmp_path_factory, "tiny_llama_kquant", eight_bit_modules=eight_bit)


@pytest.fixture(scope="session")
def code_prompts(builtin_target) -> list[list[int]]:
    """Token prompts cut from real source text, of varied lengths."""
    import email.message as source_module

    text = Path(source_module.__file__).read_text()
    tokens = builtin_target.tokenizer.encode(text)
    rng = random.Random(0)
    prompts = []
    for _ in range(24):
        start = rng.randrange(0, len(tokens) - 200)
        prompts.append(tokens[start : start + rng.randint(3, 120)])
    return prompts
