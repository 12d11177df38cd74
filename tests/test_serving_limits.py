"""Limits and per-message isolation on a live `gmlx serve`: every hostile frame fails only
itself, with an ERROR that echoes `ref` when it can be read, and the server keeps serving."""

import json

import pytest
import zmq

from ipc import messages as m
from serving_support import Server, model_dir
from workers.validate import MAX_MAX_TOKENS, MAX_STOP_BYTES, MAX_STOP_STRINGS, MAX_TOP_K

TEST_TIMEOUT_S = 120
RECV_TIMEOUT_MS = 20_000



@pytest.fixture(scope="module")
def server():
    srv = Server(model=model_dir(), drafter="none")
    yield srv
    srv.kill()


@pytest.fixture
def sock(server):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    s.connect(server.address)
    yield s
    s.close()


def make_generate(ref: str, **fields) -> list[bytes]:
    return [b"G", json.dumps({"ref": ref, "token_ids": [1, 2, 3], "max_tokens": 4, **fields}).encode()]


def recv(sock) -> tuple[bytes, dict]:
    tag, body = sock.recv_multipart()
    return tag, json.loads(body)


def assert_serves(sock, ref: str = "still-alive") -> None:
    """A valid request after the bad ones is accepted and streams to its end."""
    sock.send_multipart(make_generate(ref))
    tag, body = recv(sock)
    assert tag == b"A" and body["ref"] == ref, body
    while True:
        tag, body = recv(sock)
        assert tag == b"K", body
        if body["finish_reason"] is not None:
            return


def expect_error(sock, frames: list[bytes], field: str | None, ref: str | None) -> dict:
    sock.send_multipart(frames)
    tag, body = recv(sock)
    assert tag == b"E", body
    assert body["field"] == field and body["ref"] == ref, body
    return body


@pytest.mark.parametrize("name, value", [("max_tokens", 2**32), ("max_tokens", MAX_MAX_TOKENS + 1),
                                         ("top_k", 2**32), ("top_k", MAX_TOP_K + 1), ("max_tokens", 2**70),
                                         ("top_k", 2**64 + 5)])
def test_integers_past_their_limit_are_refused(server, sock, name, value):
    expect_error(sock, make_generate("big", **{name: value}), name, "big")
    assert_serves(sock)


def test_integers_at_their_limit_pass_validation(server, sock):
    sock.send_multipart(make_generate("edge", max_tokens=2, top_k=MAX_TOP_K, temperature=0.7))
    tag, body = recv(sock)
    assert tag == b"A", body


def test_deep_nesting_is_refused_with_its_ref(server, sock):
    deep = b'{"ref": "deep", "max_tokenz": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    body = expect_error(sock, [b"G", deep], None, None)
    assert "nests deeper" in body["message"]
    # Nesting within the limit still names the field and echoes ref.
    shallow = b'{"ref": "shallow", "max_tokenz": [[[1]]]}'
    expect_error(sock, [b"G", shallow], "max_tokenz", "shallow")
    assert_serves(sock)


def test_a_bad_stats_message_echoes_its_ref(server, sock):
    expect_error(sock, [b"S", b'{"ref": "s1", "extra": 1}'], "extra", "s1")
    expect_error(sock, [b"S", b'{"ref": "s2", "x": ' + b"[" * 500 + b"]" * 500 + b"}"], None, None)
    sock.send_multipart([b"S", b'{"ref": "s3"}'])
    tag, body = recv(sock)
    assert tag == b"T" and body["ref"] == "s3" and body["stats"]["num_rejected"] >= 2


def test_a_huge_prompt_is_refused_before_tokenizing(server, sock):
    prompt = "token " * (1_000_000 // 6)  # ~1 MB: under the message limit, over the prompt limit
    body = expect_error(sock, make_generate("huge", prompt=prompt, token_ids=None), "prompt", "huge")
    assert "bytes" in body["message"]
    assert_serves(sock)


def test_stop_strings_are_bounded(server, sock):
    expect_error(sock, make_generate("many", stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", "many")
    expect_error(sock, make_generate("long", stop=["y" * (MAX_STOP_BYTES + 1)]), "stop", "long")
    expect_error(sock, make_generate("r" * (m.MAX_REF_CHARS + 1)), "ref", None)
    expect_error(sock, [b"S", json.dumps({"ref": "s" * (m.MAX_REF_CHARS + 1)}).encode()], "ref", None)
    assert_serves(sock)


def test_an_oversized_message_is_refused(server, sock):
    body = expect_error(sock, make_generate("fat", prompt="a" * (m.MAX_MESSAGE_BYTES + 10), token_ids=None),
                        None, None)
    assert str(m.MAX_MESSAGE_BYTES) in body["message"]
    assert_serves(sock)


def test_one_bad_frame_leaves_streams_in_flight_untouched(server, sock):
    other = zmq.Context.instance().socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    other.connect(server.address)
    try:
        for i in range(4):
            sock.send_multipart(make_generate(f"s{i}", max_tokens=24))
        for frames in (make_generate("k", top_k=2**40), [b"G", b"{" * 3000], [b"G"], [b"\xff", b"{}"],
                       [b"G", b'{"ref": "x"}', b"extra"], [b"K", b"{}"]):
            other.send_multipart(frames)
        num_errors = 0
        for _ in range(6):
            tag, _ = recv(other)
            num_errors += tag == b"E"
        assert num_errors == 6
        finished = set()
        while len(finished) < 4:
            tag, body = recv(sock)
            assert tag in (b"A", b"K"), body
            if tag == b"K" and body["finish_reason"] is not None:
                assert body["finish_reason"] == "length"
                finished.add(body["request_id"])
    finally:
        other.close()
    assert server.proc.poll() is None


@pytest.mark.slow
def test_overload_is_answered_busy_with_a_retry_hint():
    # A stopped worker takes nothing off the bus: 64 slots fill, then 2 pending, then "busy".
    import os
    import signal

    srv = Server("--max-pending-requests", "2", model=model_dir(), drafter="none")
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    s.connect(srv.address)
    try:
        [worker_pid] = srv.worker_pids()
        os.kill(worker_pid, signal.SIGSTOP)
        num_requests = 64 + 2 + 5
        for i in range(num_requests):
            s.send_multipart(make_generate(f"o{i}", max_tokens=2))
        replies = [recv(s) for _ in range(num_requests)]
        busy = [body for tag, body in replies if tag == b"E"]
        assert len(busy) == 5 and all(b["message"] == "the server is busy" and b["retry_after_ms"] > 0 for b in busy)
        assert [b["ref"] for b in busy] == [f"o{i}" for i in range(66, 71)]
        # The silent worker is replaced; every accepted request is still served, and STATS counts the busy ones.
        finished = 0
        while finished < 66:
            tag, body = recv(s)
            assert tag == b"K", body
            finished += body["finish_reason"] is not None
        s.send_multipart([b"S", b'{"ref": "st"}'])
        tag, body = recv(s)
        assert tag == b"T" and body["stats"]["num_rejected"] == 5
    finally:
        s.close()
        srv.kill()
