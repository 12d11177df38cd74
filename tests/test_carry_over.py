"""A request carried over to another worker when its own died mid-stream (workers/streams.py).

The next worker prefills the prompt and every token already streamed, marked as generated
(BusPayload.num_generated), with the same seed and max_tokens. Exactness rests on three engine
properties: a position's logits do not depend on whether its tokens were prefilled or decoded,
sampling draws from (seed, position) alone, and what sampling counts (repeat penalties,
min_tokens, max_tokens) counts the carried tokens as generated. The in-process tests check the continuation equals the rest of the
uninterrupted stream, cut at random points, arriving at random rounds beside the other cuts, on a float32 model
and on the GGUF-like models (int8 activations, float16 KV; one mixing 4 and 8 bits in its layers as a
K-quant file does); the live test kills a worker.
"""

import dataclasses
import os
import random
import signal
import time

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import SamplingParams
from gmlx.textstream import TextStream
from ipc import messages as m
from ipc.bus import BusPayload
from ipc.client import Client, RequestError
from schedules import Arrival, Schedule, SoloReference, run_schedule
from serving_support import Server, model_dir, solo
from workers.streams import MAX_WORKER_LOSSES, ClientRequest, Phase

TEST_TIMEOUT_S = 240


@pytest.mark.parametrize("target_name", ["builtin_target", "gguf_like_target", "kquant_like_target"])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_continuation_from_any_cut_is_the_rest_of_the_stream(target_name, drafter, code_prompts, request):
    target = request.getfixturevalue(target_name)
    reference = SoloReference(target)
    engine = Engine(target, make_drafter(drafter, target), EngineConfig(prompt_cache_bytes=0))
    rng = random.Random(f"{target_name} {drafter}")  # str seeds are hashed the same in every process
    for _ in range(3):  # schedules
        pairs = []  # (the carried request's arrival, what it must emit)
        for i in range(6):
            prompt = [t % target.vocab_size for t in code_prompts[rng.randrange(len(code_prompts))]]
            sampled = i % 2 == 1
            params = SamplingParams(max_tokens=rng.randint(8, 40), temperature=0.8 if sampled else 0.0,
                                    top_p=0.9 if sampled else 1.0, seed=rng.getrandbits(63))
            if i % 3 == 2:  # what counts generated tokens: penalties, min_tokens (stopping on a likely token)
                params = dataclasses.replace(params, presence_penalty=0.5, frequency_penalty=0.3,
                                             repetition_penalty=1.2, min_tokens=rng.randint(0, 8),
                                             stop_token_ids=(prompt[-1],))
            full, reason = reference.tokens(prompt, params)
            if len(full) < 2:
                continue
            cut = rng.randrange(1, len(full))  # tokens streamed before the worker died
            pairs.append((Arrival(rng.randint(0, 6), tuple(prompt + full[:cut]), params, None, num_generated=cut),
                          (full[cut:], reason)))
        assert len(pairs) >= 4
        pairs.sort(key=lambda pair: pair[0].round_index)
        # At random rounds, under a random width cap: they join running batches as any request does.
        schedule = Schedule(0, rng.choice((0, 1, 2, 4)), True, True, 2, tuple(arrival for arrival, _ in pairs))
        result = run_schedule(engine, schedule)
        assert [(result.tokens[i], result.finish[i]) for i in range(len(pairs))] == [e for _, e in pairs]


def test_num_generated_must_leave_a_prompt_and_a_token_to_generate(builtin_target):
    engine = Engine(builtin_target, None, EngineConfig())
    for token_ids, num_generated, max_tokens in (([1, 2], 2, 8), ([1, 2, 3], 1, 1), ([1, 2], -1, 8)):
        with pytest.raises(ValueError, match="^num_generated: "):
            engine.add_request(token_ids, SamplingParams(max_tokens=max_tokens), num_generated=num_generated)


def make_client_request(prompt: list[int], max_tokens: int, seed: int | None = 7,
                        stop: tuple[str, ...] = ()) -> ClientRequest:
    from workers.tokenizer import load_tokenizer

    _, decoder = load_tokenizer(str(model_dir()))
    sampling = m.Sampling(max_tokens=max_tokens, seed=seed)
    return ClientRequest("r1", "ref", b"client", BusPayload(token_ids=prompt, sampling=sampling),
                         TextStream(decoder, stop), "model", has_stop=bool(stop))


def test_each_carry_over_sends_the_prompt_and_every_streamed_token_until_the_bound():
    req = make_client_request([5, 6, 7], max_tokens=10)
    streamed = []
    for loss in range(MAX_WORKER_LOSSES + 1):
        req.phase, req.worker_id = Phase.INJECTED, loss
        for seq, token in enumerate((20 + loss, 30 + loss)):
            out = req.on_row(m.RowOutput(request_id="r1", seq=seq, token_ids=[token]), 0)
            assert [type(msg) for msg in out.messages] == [m.Chunk]
            streamed.append(token)
        if loss == MAX_WORKER_LOSSES:
            assert not req.carry_over()  # one loss too many: the front-end fails it
            break
        assert req.carry_over()
        assert (req.phase, req.worker_id, req.next_row_seq) == (Phase.PENDING, None, 0)
        assert req.payload.token_ids == [5, 6, 7, *streamed] and req.payload.num_generated == len(streamed)
        assert req.payload.sampling == req.client_payload.sampling  # max_tokens and seed the client's
    assert req.num_prompt_tokens == 3 and req.num_worker_losses == MAX_WORKER_LOSSES


def test_prompt_logprobs_go_out_once_whatever_worker_is_lost():
    """The first row's prompt logprobs make the first chunk's (the first token with a null
    logprob); a carry-over after that chunk asks the next worker for none, one before it still
    does; a first row without them fails the request rather than send a short list."""
    from workers.tokenizer import load_tokenizer

    _, decoder = load_tokenizer(str(model_dir()))
    sampling = m.Sampling(max_tokens=10, seed=7, logprobs=1, prompt_logprobs=1)

    def make():
        return ClientRequest("r1", "ref", b"client", BusPayload(token_ids=[5, 6, 7], sampling=sampling),
                             TextStream(decoder), "model", has_stop=False)

    entry = [-0.5, [[9, -0.5]]]
    req = make()
    assert req.carry_over() is False  # still pending: nothing to carry
    req.phase = Phase.INJECTED
    assert req.carry_over() and req.payload.sampling.prompt_logprobs == 1  # lost before its first chunk
    req.phase = Phase.INJECTED
    [chunk] = req.on_row(m.RowOutput("r1", 0, [20], logprobs=[entry], prompt_logprobs=[entry, entry]), 0).messages
    assert [e["token_id"] for e in chunk.prompt_logprobs] == [5, 6, 7]
    assert chunk.prompt_logprobs[0]["logprob"] is None and chunk.prompt_logprobs[1]["logprob"] == -0.5
    assert req.carry_over() and req.payload.sampling.prompt_logprobs is None
    req.phase = Phase.INJECTED
    [chunk] = req.on_row(m.RowOutput("r1", 0, [21], logprobs=[entry]), 0).messages
    assert isinstance(chunk, m.Chunk) and chunk.prompt_logprobs is None and len(chunk.logprobs) == 1
    req = make()
    req.phase = Phase.INJECTED
    [error] = req.on_row(m.RowOutput("r1", 0, [20], logprobs=[entry]), 0).messages
    assert isinstance(error, m.Error) and "prompt" in error.message


def test_an_unseeded_request_has_its_seed_pinned_when_accepted():
    seeds = {make_client_request([5], max_tokens=4, seed=None).payload.sampling.seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= seed < 2**63 for seed in seeds)  # drawn at random, each its own
    req = make_client_request([5], max_tokens=4, seed=None)
    assert req.client_payload == req.payload and make_client_request([5], 4, seed=3).payload.sampling.seed == 3


@pytest.mark.parametrize("why", ["stop string", "cancel"])
def test_a_stopping_request_whose_worker_dies_ends_with_its_final_chunk(why):
    """Its client already has every token it is owed: no carry-over, no error, the final chunk."""
    from workers.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(str(model_dir()))
    words = tokenizer.encode(" alpha beta gamma")
    req = make_client_request([5], max_tokens=50, stop=(" beta",) if why == "stop string" else ())
    req.phase = Phase.INJECTED
    out = req.on_row(m.RowOutput(request_id="r1", seq=0, token_ids=words), 0)
    if why == "cancel":
        req.phase = Phase.STOPPING  # what the front-end sets when the client cancels
    assert req.phase == Phase.STOPPING and not req.carry_over()
    final = req.stopped_without_worker()
    assert final.finish_reason == ("stop" if why == "stop string" else "cancelled")
    delivered = sum(len(msg.token_ids) for msg in out.messages)
    assert final.stats["generated_tokens"] == delivered and final.stats["prompt_tokens"] == 1
    assert req.phase == Phase.FINISHED


def test_a_request_that_streamed_max_tokens_is_not_carried_over():
    req = make_client_request([5], max_tokens=2)
    req.phase = Phase.INJECTED
    req.on_row(m.RowOutput(request_id="r1", seq=0, token_ids=[8, 9]), 0)
    assert not req.carry_over()


@pytest.mark.slow
def test_a_sampled_stream_goes_on_on_the_restarted_worker_until_the_bound():
    """One worker, killed mid-stream: an unseeded sampled stream (the front-end pinned its seed)
    waits for the restart and ends as solo decoding with that seed would. Then a stream whose
    every worker is killed ends with an error once MAX_WORKER_LOSSES is passed, and the server
    serves on. (test_serving_e2e kills one of two workers under greedy streams.)"""
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    engine = Engine.load(EngineConfig(drafter="none"))
    prompt = engine.tokenizer.encode("def main(")
    num_tokens = 800  # the built-in model decodes these in ~0.3 s: the kill lands well before the end
    srv = Server(model=model_dir(), drafter="none")
    try:
        with Client(srv.address, timeout_s=120) as client:
            [pid] = srv.worker_pids()
            tokens = []
            for chunk in client.generate(token_ids=prompt, max_tokens=num_tokens, temperature=0.7):
                if not tokens:
                    os.kill(pid, signal.SIGKILL)
                tokens += chunk.token_ids
            stats = chunk.stats
            assert (stats["num_worker_losses"], stats["prompt_tokens"]) == (1, len(prompt)), srv.log()
            assert stats["generated_tokens"] == len(tokens)
            expected = solo(engine, prompt, max_tokens=num_tokens, temperature=0.7, seed=stats["seed"])
            assert (tokens, chunk.finish_reason) == expected

            killed = set()
            with pytest.raises(RequestError, match="lost"):
                for _ in client.generate(token_ids=prompt, max_tokens=num_tokens, temperature=0.7):
                    for pid in set(srv.worker_pids()) - killed:
                        killed.add(pid)
                        os.kill(pid, signal.SIGKILL)
            deadline_s = time.monotonic() + 60
            while (server_stats := client.stats())["num_workers"] < 1:
                assert time.monotonic() < deadline_s, srv.log()
                time.sleep(0.2)
            assert server_stats["num_carried_over"] == 1 + MAX_WORKER_LOSSES
            chunks = list(client.generate(token_ids=prompt, max_tokens=8))  # and it serves on
            assert chunks[-1].finish_reason == "length"
        assert srv.terminate() == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.kill()
