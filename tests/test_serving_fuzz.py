"""Property-based fuzzing of a live front-end: random valid-looking and mutated frames
from every named class (scripts/frames.py), each followed by a STATS probe. The server must
answer every frame, refuse the hostile ones, serve the valid ones, and stay up."""

import random

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import frames
from serving_support import Server, model_dir

TEST_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server():
    srv = Server(model=model_dir(), drafter="none")  # its start has a deadline of its own
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def prober(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    yield frames.Prober(sock)
    sock.close()


def check(server, frame: frames.FuzzFrame, seen: frames.Observation) -> None:
    assert seen.outcome != "hang", (frame.name, frame.frames[:1])
    assert server.proc.poll() is None, server.log()
    if frame.is_valid:
        assert seen.outcome in frames.SERVED, (frame, seen)
    if frame.name in frames.ALWAYS_REFUSED:
        assert seen.outcome in ("error", "error+ref"), (frame, seen)
    assert seen.outcome not in ("gap", "failed_after_accept", "bad_logprobs"), (frame, seen)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(draws=st.lists(st.tuples(st.sampled_from(sorted(frames.CLASSES)), st.integers(0, 2**32)),
                      min_size=1, max_size=8))
def test_every_frame_is_answered_and_the_server_keeps_serving(server, prober, draws):
    for name, seed in draws:
        frame = frames.draw(random.Random(seed), name)
        check(server, frame, prober.observe(frame))
    valid = frames.draw(random.Random(0), "valid_generate")
    check(server, valid, prober.observe(valid))


def test_every_class_once(server, prober):
    rng = random.Random(1)
    for name in frames.CLASSES:
        for _ in range(3):
            frame = frames.draw(rng, name)
            check(server, frame, prober.observe(frame))
