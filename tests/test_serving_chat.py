"""Chat `messages` and per-request `speculate` on the wire: validation with the real tokenizer,
and a real `gmlx serve` whose streams are checked against solo in-process decoding."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from ipc import messages as m
from ipc.bus import BusPayload, RequestBus
from ipc.client import AsyncClient, Client, RequestError
from serving_support import BUILTIN_TARGET, REPO_ROOT, Server, make_chat_model_dir, repo_env
from workers.tokenizer import load_tokenizer
from workers.validate import (MAX_CHAT_MESSAGES, InvalidRequest, ModelLimits, sampling_params,
                              validate_generate)

TEST_TIMEOUT_S = 150  # hard: a hung socket must fail the run, not stall it
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(argv):"}]



@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    return make_chat_model_dir(tmp_path_factory.mktemp("models") / "builtin-chat")


@pytest.fixture(scope="module")
def chat_tokenizer(chat_model_dir):
    return load_tokenizer(str(chat_model_dir))[0]


def rendered_ids(tokenizer, messages) -> list[int]:
    """The test's own rendering: transformers' template, encoded without added specials."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith(f"### {messages[0]['role']}\n{messages[0]['content']}\n")
    return tokenizer.encode(text, add_special_tokens=False)


LIMITS = ModelLimits(vocab_size=4096, max_prompt_tokens=5000, max_prompt_bytes=2000)


def check(tokenizer, **fields) -> tuple[BusPayload, tuple[str, ...]]:
    return validate_generate(m.Generate(ref="r", **fields), tokenizer, LIMITS)


def rejected_field(tokenizer, **fields) -> str:
    with pytest.raises(InvalidRequest) as info:
        check(tokenizer, **fields)
    return info.value.field


# --- validation, in-process, with the real tokenizer ------------------------------------


def test_messages_render_with_the_template(chat_tokenizer):
    payload, _ = check(chat_tokenizer, messages=[m.ChatMessage(**turn) for turn in CHAT], max_tokens=5)
    assert payload.token_ids == rendered_ids(chat_tokenizer, CHAT)
    assert payload.sampling == m.Sampling(max_tokens=5)


def test_exactly_one_input_and_chat_limits(chat_tokenizer):
    turn = m.ChatMessage(role="user", content="hi")
    assert rejected_field(chat_tokenizer, prompt="x", messages=[turn]) == "prompt"
    assert rejected_field(chat_tokenizer, token_ids=[1], messages=[turn]) == "prompt"
    assert rejected_field(chat_tokenizer) == "prompt"
    assert rejected_field(chat_tokenizer, messages=[]) == "messages"
    assert rejected_field(chat_tokenizer, messages=[turn] * (MAX_CHAT_MESSAGES + 1)) == "messages"
    # The byte limit counts every content together, and multi-byte characters as their bytes.
    assert rejected_field(chat_tokenizer, messages=[m.ChatMessage("user", "a" * 1001)] * 2) == "messages"
    assert rejected_field(chat_tokenizer, messages=[m.ChatMessage("user", "é" * 1001)]) == "messages"
    assert rejected_field(chat_tokenizer, messages=[m.ChatMessage("x" * 65, "hi")]) == "messages"
    check(chat_tokenizer, messages=[m.ChatMessage("user", "a" * 1000)] * 2)


def test_a_model_without_a_chat_template_names_messages():
    tokenizer = load_tokenizer(str(BUILTIN_TARGET))[0]
    with pytest.raises(InvalidRequest, match="chat template") as info:
        check(tokenizer, messages=[m.ChatMessage("user", "hi")])
    assert info.value.field == "messages"


def test_speculate_travels_from_the_wire_through_the_bus_to_sampling_params(chat_tokenizer):
    frames = [m.Generate.TAG, json.dumps({"ref": "r", "prompt": "def f(", "speculate": False,
                                          "temperature": 1, "seed": 3}).encode()]
    msg = m.decode_json(frames)
    payload, stop = validate_generate(msg, chat_tokenizer, LIMITS)
    owner = RequestBus.create(num_slots=1, max_tokens=64)
    try:
        reader = RequestBus.attach(owner.name)
        params = sampling_params(reader.read(*owner.write(payload)).sampling, stop)
        reader.close()
    finally:
        owner.close()
    assert params.speculate is False and params.temperature == 1.0 and params.seed == 3
    assert type(params.temperature) is float  # JSON's 1 arrives as the float the engine expects
    with pytest.raises(m.WireError) as info:
        m.decode_json([m.Generate.TAG, b'{"ref": "r", "prompt": "x", "speculate": "no"}'])
    assert info.value.field == "speculate"
    with pytest.raises(m.WireError) as info:
        m.decode_json([m.Generate.TAG, b'{"ref": "r", "messages": [{"role": "user"}]}'])
    assert info.value.field == "messages"


def test_the_wire_sampling_fields_are_the_engines():
    from gmlx.request import SamplingParams

    engine_fields = set(SamplingParams.__dataclass_fields__) - {"stop"}
    assert set(m.Sampling.__struct_fields__) == engine_fields
    assert msgspec.structs.asdict(m.Sampling()) == {name: getattr(SamplingParams(), name) for name in engine_fields}


def test_the_http_gateway_forwards_speculate():
    import inspect

    from workers import http_openai

    kwargs = http_openai.parse_completion({"model": "m", "prompt": "x", "speculate": False}).client_kwargs()
    assert kwargs["speculate"] is False
    inspect.signature(AsyncClient.generate).bind(None, **kwargs)  # the client takes every argument


# --- a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine

    return Engine.load(EngineConfig(model_path=str(chat_model_dir), drafter="ngram"))


@pytest.fixture(scope="module")
def server(chat_model_dir):
    srv = Server(model=chat_model_dir, drafter="ngram")
    yield srv
    assert srv.terminate() == 0, srv.log()


def solo(engine, token_ids, **params) -> list[int]:
    """The request decoded alone by the in-process library path."""
    from gmlx.generate import stream_generate
    from gmlx.request import SamplingParams

    return [t for chunk in stream_generate(engine, params=SamplingParams(**params), token_ids=list(token_ids))
            for t in chunk.token_ids]


def test_chat_streams_equal_solo_decoding_of_the_rendered_prompt(server, engine, chat_tokenizer):
    want = solo(engine, rendered_ids(chat_tokenizer, CHAT), max_tokens=16)
    with Client(server.address, timeout_s=60) as client:
        chunks = list(client.generate(messages=CHAT, max_tokens=16))
        assert [t for c in chunks for t in c.token_ids] == want
        with pytest.raises(RequestError) as info:
            list(client.generate("x", messages=CHAT))
        assert info.value.field == "prompt"
        with pytest.raises(ValueError, match="messages"):
            list(client.generate(messages=[{"role": "user"}]))

    async def run_async():
        async with AsyncClient(server.address, timeout_s=60) as client:
            return [t async for c in client.generate(messages=CHAT, max_tokens=16) for t in c.token_ids]

    assert asyncio.run(run_async()) == want


def test_speculate_false_streams_the_same_tokens(server, engine):
    prompt_ids = engine.tokenizer.encode("import json\n\ndef load(path):")
    want = solo(engine, prompt_ids, max_tokens=24)
    sampled = solo(engine, prompt_ids, max_tokens=24, temperature=0.8, seed=5)
    with Client(server.address, timeout_s=60) as client:
        for speculate in (False, True):
            chunks = list(client.generate(token_ids=prompt_ids, max_tokens=24, speculate=speculate))
            assert [t for c in chunks for t in c.token_ids] == want
            assert chunks[-1].stats["speculate"] is speculate  # the worker's engine got the flag
            if not speculate:  # and honoured it: an opted-out row never drafts
                assert chunks[-1].stats["num_drafted"] == 0
            got = [t for c in client.generate(token_ids=prompt_ids, max_tokens=24, temperature=0.8, seed=5,
                                              speculate=speculate) for t in c.token_ids]
            assert got == sampled


def test_tokenize_gives_what_generate_prefills_and_detokenize_what_streams_spell(server, engine, chat_tokenizer):
    """TOKENIZE / DETOKENIZE (session 49): a prompt's and a chat's ids are the ones a generation
    prefills (ACCEPTED's count, and solo decoding of them streams the same tokens); the text of a
    stream's ids is the stream's text; bad ones are errors naming the field, for both clients."""
    prompt = "import json\n\ndef load(path):"
    with Client(server.address, timeout_s=60) as client:
        ids = client.tokenize(prompt)
        assert ids == engine.tokenizer.encode(prompt)
        chat_ids = client.tokenize(messages=CHAT)
        assert chat_ids == rendered_ids(chat_tokenizer, CHAT)
        chunks = list(client.generate(messages=CHAT, max_tokens=12))
        assert chunks[-1].stats["prompt_tokens"] == len(chat_ids)
        out = [t for c in chunks for t in c.token_ids]
        assert out == solo(engine, chat_ids, max_tokens=12)
        assert client.detokenize(out) == "".join(c.text for c in chunks)
        assert client.detokenize(chat_ids + out) == chat_tokenizer.decode(chat_ids + out)
        for call, field in ((lambda: client.tokenize(), "prompt"), (lambda: client.tokenize("a", messages=CHAT), "prompt"),
                            (lambda: client.detokenize([engine.target.vocab_size]), "token_ids"),
                            (lambda: client.detokenize([-1]), "token_ids")):
            with pytest.raises(RequestError) as info:
                call()
            assert info.value.field == field
        with pytest.raises(ValueError, match="^prompt: not valid Unicode"):
            client.tokenize("\ud800")
        assert client.stats()["num_workers"] == 1  # the connection still serves

    async def run_async():
        async with AsyncClient(server.address, timeout_s=60) as client:
            return await client.tokenize(prompt), await client.detokenize(ids)

    assert asyncio.run(run_async()) == (ids, chat_tokenizer.decode(ids))


def test_raw_chat_frame_is_answered(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send_multipart([m.Generate.TAG, json.dumps({"ref": "raw", "messages": [{"role": "user", "content": 5}]})
                             .encode()])
        assert sock.poll(30_000)
        reply = m.decode_json(sock.recv_multipart())
        assert isinstance(reply, m.Error) and reply.ref == "raw" and reply.field == "messages"
    finally:
        sock.close()


def test_generate_cli_chat_and_no_speculate_through_the_server(server, engine, chat_tokenizer):
    cmd = [sys.executable, "-c", "from workers.cli import main; main()", "generate", "def parse(argv):",
           "--chat", "--no-speculate", "--server", server.address, "--max-tokens", "12", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    want = solo(engine, rendered_ids(chat_tokenizer, [{"role": "user", "content": "def parse(argv):"}]),
                max_tokens=12)
    assert result["token_ids"] == want


def test_generate_cli_in_process_no_speculate_and_chat_without_server():
    base = [sys.executable, "-c", "from workers.cli import main; main()", "generate", "def parse(argv):"]
    out = subprocess.run(base + ["--no-speculate", "--drafter", "ngram", "--max-tokens", "4", "--json"],
                         capture_output=True, text=True, timeout=120, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["stats"]["speculate"] is False
    out = subprocess.run(base + ["--chat"], capture_output=True, text=True, timeout=120, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 2 and "--chat" in out.stderr
