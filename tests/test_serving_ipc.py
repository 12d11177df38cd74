"""The wire messages and the shared-memory request bus, in one process (no sockets)."""

import os
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import messages as m
from ipc.bus import BusPayload, RequestBus, StaleSlotError, list_segments, parse_owner, reclaim_stale_segments


def make_payload(num_tokens: int = 5, seed: int | None = 7) -> BusPayload:
    return BusPayload(list(range(num_tokens)), m.Sampling(max_tokens=32, temperature=0.8, top_p=0.9, top_k=40,
                                                           min_p=0.05, seed=seed))


@pytest.fixture
def bus():
    owner = RequestBus.create(num_slots=4, max_tokens=64)
    yield owner
    owner.close()


@settings(max_examples=50, deadline=None)
@given(token_ids=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=64),
       seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
       temperature=st.floats(0, 10), top_k=st.integers(0, 2**31), max_tokens=st.integers(1, 2**32 - 1),
       speculate=st.booleans(), logprobs=st.one_of(st.none(), st.integers(0, 20)),
       penalty=st.floats(-2, 2),
       logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, 2**32 - 1), st.floats(-100, 100), max_size=300)),
       stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=64))
def test_bus_round_trips_any_payload(token_ids, seed, temperature, top_k, max_tokens, speculate, logprobs, penalty,
                                     logit_bias, stop_token_ids):
    owner = RequestBus.create(num_slots=2, max_tokens=64)
    try:
        reader = RequestBus.attach(owner.name)
        payload = BusPayload(token_ids, m.Sampling(max_tokens, temperature, 1.0, top_k, 0.0, seed, speculate, logprobs,
                                                   logprobs, penalty, -penalty, logit_bias,
                                                   repetition_penalty=1 + penalty / 4, ignore_eos=speculate,
                                                   min_tokens=max_tokens // 2, stop_token_ids=tuple(stop_token_ids)),
                             num_generated=len(token_ids) // 2)
        slot, generation = owner.write(payload)
        assert reader.read(slot, generation) == payload
        reader.close()
    finally:
        owner.close()


def test_the_widest_sampling_fits_a_slot_header():
    # Every field at its widest encoding: 300 logit_bias tokens and 64 stop tokens of 32-bit ids.
    widest = m.Sampling(2**32 - 1, 0.1, 0.1, 2**32 - 1, 0.1, 2**63 - 1, False, 20, 20, -0.1, -0.1,
                        {2**32 - 1 - i: -0.1 for i in range(m.MAX_LOGIT_BIAS_ENTRIES)}, repetition_penalty=0.1,
                        ignore_eos=True, min_tokens=2**32 - 1, stop_token_ids=(2**32 - 1,) * m.MAX_STOP_TOKEN_IDS)
    bus = RequestBus.create(num_slots=1, max_tokens=8)
    try:
        reader = RequestBus.attach(bus.name)
        payload = BusPayload([1, 2], widest)
        assert reader.read(*bus.write(payload)) == payload
        reader.close()
    finally:
        bus.close()


def test_bus_is_bounded_and_slots_come_back(bus):
    placed = [bus.write(make_payload()) for _ in range(4)]
    assert all(p is not None for p in placed)
    assert bus.write(make_payload()) is None  # full: the front-end keeps the request pending
    bus.release(placed[2][0])
    slot, generation = bus.write(make_payload(seed=None))
    assert slot == placed[2][0] and generation == placed[2][1] + 1


def test_bus_refuses_a_stale_descriptor():
    bus = RequestBus.create(num_slots=1, max_tokens=8)
    reader = RequestBus.attach(bus.name)
    slot, generation = bus.write(make_payload())
    bus.release(slot)
    assert bus.write(make_payload(3))[0] == slot  # reused: the old descriptor must not read it
    with pytest.raises(StaleSlotError):
        reader.read(slot, generation)
    with pytest.raises(StaleSlotError):
        reader.read(99, 1)
    reader.close()
    bus.close()


def test_bus_rejects_oversized_prompt(bus):
    with pytest.raises(ValueError, match="token_ids"):
        bus.write(make_payload(num_tokens=65))


def test_attaching_and_detaching_leaves_the_segment_alone(bus):
    # A worker attaches in another process and exits: the owner's segment must survive.
    code = f"from ipc.bus import RequestBus; RequestBus.attach({bus.name!r}).close()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert bus.name in list_segments()


def test_closing_the_owner_unlinks():
    owner = RequestBus.create(num_slots=1, max_tokens=8)
    name = owner.name
    owner.close()
    assert name not in list_segments()


def test_stale_segments_of_dead_owners_are_reclaimed(bus):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale_name = f"gmlx_{proc.pid}_1_0"  # a pid that is gone
    shm = shared_memory.SharedMemory(name=stale_name, create=True, size=64)
    resource_tracker.unregister(shm._name, "shared_memory")  # as if its owner had been killed
    shm.close()
    assert parse_owner(stale_name) == (proc.pid, "1")
    removed = reclaim_stale_segments()
    assert stale_name in removed
    assert bus.name in list_segments()  # a live owner's segment stays


def test_client_messages_round_trip():
    msg = m.Generate(ref="a", prompt="def f(", max_tokens=3, stop=["\n"])
    assert m.decode_json(m.encode_json(msg)) == msg
    chunk = m.Chunk(request_id="r1", seq=2, token_ids=[1, 2], text="ab", finish_reason="length", stats={"x": 1})
    assert m.decode_json(m.encode_json(chunk)) == chunk
    entry = {"token_id": 1, "token": "a", "logprob": -0.5,
             "top_logprobs": [{"token_id": 1, "token": "a", "logprob": -0.5}]}
    with_logprobs = m.Chunk(request_id="r1", seq=3, token_ids=[1], text="a", logprobs=[entry])
    assert m.decode_json(m.encode_json(with_logprobs)) == with_logprobs


class ChunkBeforeLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """CHUNK as clients from before the logprobs field decode it (every field written out)."""

    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    emitted_at_ns: int | None = None


class GenerateBeforeLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ref: str
    prompt: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    speculate: bool = True


def test_clients_and_servers_from_before_logprobs_read_what_does_not_use_them():
    chunk = m.Chunk(request_id="r1", seq=2, token_ids=[1, 2], text="ab", finish_reason="length", stats={"x": 1},
                    emitted_at_ns=5)
    old = msgspec.json.decode(m.encode_json(chunk)[1], type=ChunkBeforeLogprobs)
    assert msgspec.structs.asdict(old) == {k: v for k, v in msgspec.structs.asdict(chunk).items()
                                           if k not in ("logprobs", "prompt_logprobs")}
    generate = m.Generate(ref="a", prompt="def f(", max_tokens=3, temperature=0.5)
    old = msgspec.json.decode(m.encode_json(generate)[1], type=GenerateBeforeLogprobs)
    assert (old.ref, old.prompt, old.max_tokens, old.temperature, old.speculate) == ("a", "def f(", 3, 0.5, True)


@pytest.mark.parametrize("frames, field, match", [
    ([b"G"], None, "2 frames"),
    ([b"G", b"{}", b"x"], None, "2 frames"),
    ([b"Q", b"{}"], "type", "unknown message type"),
    ([b"G", b"{not json"], None, "not valid JSON"),
    ([b"G", b"[1, 2]"], None, "Expected `object`"),
    ([b"G", b'{"prompt": "x"}'], "ref", "missing required field `ref`"),
    ([b"G", b'{"ref": "a", "max_tokens": "7"}'], "max_tokens", "Expected `int`"),
    ([b"G", b'{"ref": "a", "temperature": "hot"}'], "temperature", "Expected `float`"),
    ([b"G", b'{"ref": "a", "token_ids": [1, "x"]}'], "token_ids", "Expected `int`"),
    ([b"G", b'{"ref": "a", "max_tokenz": 7}'], "max_tokenz", "unknown field"),
    ([b"G", b'{"ref": "' + b"x" * m.MAX_MESSAGE_BYTES + b'"}'], None, "over the limit"),
])
def test_bad_client_messages_name_the_problem(frames, field, match):
    with pytest.raises(m.WireError, match=match) as info:
        m.decode_json(frames)
    assert info.value.field == field


def test_worker_messages_round_trip_msgpack():
    row = m.RowOutput("r1", 3, [4, 5], "stop", {"num_rounds": 2}, None)
    msg = m.Round(worker_id=1, round_index=9, emitted_at_ns=123, outputs=[row])
    assert m.decode_msgpack(m.encode_msgpack(msg)) == msg


def test_field_of_engine_and_params_errors():
    assert m.field_of("token_ids: the prompt is empty") == "token_ids"
    assert m.field_of("top_p must be in (0, 1], got 0") == "top_p"
    assert m.field_of("worker 2 exited with code -9") is None


def test_ipc_and_the_front_end_never_import_mlx():
    code = ("import sys, ipc.client, ipc.bus, ipc.messages, ipc.sockets, workers.frontend, workers.cli_serve; "
            "bad = [n for n in sys.modules if n == 'mlx' or n.startswith(('mlx.', 'mlx_lm'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
