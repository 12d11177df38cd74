"""The KV budget (gmlx/cache/budget.py): rows join only while their KV fits it, the rest wait
in arrival order, rows that grow past it are evicted latest arrival first and resume by
re-prefill, every stream still equals plain decoding, and what one row may hold alone bounds a
request as the context does (a longer prompt refused naming the budget, generation stopped
there), in process and over a live server."""

import dataclasses
import random
import threading

import pytest

from gmlx.cache.budget import KVBudget, default_budget_bytes
from gmlx.cache.ragged import STEP_TOKENS
from gmlx.config import EngineConfig, env_overrides
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import Request, SamplingParams
from ipc.client import Client, RequestError
from schedules import SoloReference, check_schedule, make_schedule, run_alone
from serving_support import Server
from workers.supervisor import WorkerSpec


def test_a_row_is_as_wide_as_it_may_grow_rounded_to_the_growth_step():
    budget = KVBudget(bytes_per_token=10, budget_bytes=10 * 4 * STEP_TOKENS, margin_tokens=5)
    assert budget.row_tokens(100, 40) == STEP_TOKENS
    assert budget.row_tokens(200, 52) == 2 * STEP_TOKENS  # 257 with the margin
    assert budget.rows_bytes(3, STEP_TOKENS) == 3 * STEP_TOKENS * 10


def test_a_row_reserves_what_it_holds_and_its_growth_up_to_the_reserve():
    whole = KVBudget(bytes_per_token=10, budget_bytes=10**6, margin_tokens=5, reserve_tokens=0)
    ahead = KVBudget(bytes_per_token=10, budget_bytes=10**6, margin_tokens=5, reserve_tokens=8)
    assert whole.reserved_tokens(240, 100) == 2 * STEP_TOKENS  # all it may generate: 345
    assert ahead.reserved_tokens(240, 100) == STEP_TOKENS  # 240 + 8 + 5
    assert ahead.reserved_tokens(244, 100) == 2 * STEP_TOKENS  # 257: past the step
    assert ahead.reserved_tokens(240, 3) == whole.reserved_tokens(240, 3) == STEP_TOKENS  # 3 left: all of it


def test_waiters_are_admitted_in_arrival_order_while_the_widest_row_fits():
    budget = KVBudget(bytes_per_token=1, budget_bytes=4 * STEP_TOKENS, margin_tokens=0)
    narrow, wide = STEP_TOKENS, 2 * STEP_TOKENS
    assert budget.num_admissible(0, 0, [narrow] * 9, max_new_rows=9) == 4
    assert budget.num_admissible(0, 0, [narrow] * 9, max_new_rows=3) == 3
    assert budget.num_admissible(1, narrow, [narrow, wide, narrow], max_new_rows=9) == 1  # 3 rows x wide > 4
    assert budget.num_admissible(2, wide, [narrow], max_new_rows=9) == 0  # the buffers' width counts
    assert budget.num_admissible(0, 0, [wide, wide, narrow], max_new_rows=9) == 2


def _request(seq: int, num_prompt: int, num_generated: int = 0, max_new: int = 100) -> Request:
    request = Request(f"r{seq}", [1] * num_prompt, SamplingParams(), seed=0, arrival_seq=seq, max_new_tokens=max_new)
    request.output_token_ids.extend([1] * num_generated)
    return request


def test_a_requests_row_is_charged_what_it_holds_and_its_reserve():
    budget = KVBudget(bytes_per_token=1, budget_bytes=10**6, margin_tokens=5, reserve_tokens=8)
    assert budget.reserved_for(_request(0, 240)) == budget.reserved_tokens(240, 100) == STEP_TOKENS
    assert budget.reserved_for(_request(0, 240, num_generated=4)) == 2 * STEP_TOKENS  # 244 held + 8 + 5
    assert budget.reserved_for(_request(0, 240, num_generated=97)) == 2 * STEP_TOKENS  # 337 held + 3 left + 5


def test_rows_in_flight_and_the_buffers_width_bound_who_joins():
    budget = KVBudget(bytes_per_token=1, budget_bytes=4 * STEP_TOKENS, margin_tokens=0, reserve_tokens=0)
    narrow, wide = _request(0, 100), _request(1, STEP_TOKENS)  # one step wide; two steps wide
    assert budget.num_admissible_requests([narrow], 0, [_request(2, 10)] * 5, max_new_rows=9) == 3
    assert budget.num_admissible_requests([narrow], 2 * STEP_TOKENS, [_request(2, 10)] * 5, max_new_rows=9) == 1
    assert budget.num_admissible_requests([wide], 0, [_request(2, 10)] * 5, max_new_rows=9) == 1


def test_the_latest_arrival_gives_way_until_the_rest_fit_and_the_earliest_never_does():
    budget = KVBudget(bytes_per_token=1, budget_bytes=4 * STEP_TOKENS, margin_tokens=0, reserve_tokens=0)
    rows = [_request(seq, STEP_TOKENS) for seq in (3, 0, 5, 1)]  # two steps each: two fit
    assert budget.next_victim(rows, 0).arrival_seq == 5
    assert budget.next_victim([r for r in rows if r.arrival_seq != 5], 0).arrival_seq == 3
    assert budget.next_victim([r for r in rows if r.arrival_seq in (0, 1)], 0) is None
    assert budget.next_victim([rows[1]], 10 * STEP_TOKENS) is None  # alone, whatever it holds
    # Narrow rows in buffers four steps wide: the buffers' width is what they hold.
    narrow = [_request(seq, 10) for seq in range(3)]
    assert budget.next_victim(narrow, 4 * STEP_TOKENS).arrival_seq == 2
    assert budget.next_victim(narrow, STEP_TOKENS) is None


@pytest.mark.parametrize("kind", [None, "ngram"])
def test_a_request_stops_at_what_one_row_may_hold_and_a_longer_prompt_is_refused(kind, builtin_target):
    """A budget of one growth step: a row holds 256 tokens less a verify's margin. A request
    asking past that decodes up to it and stops with "length", as at the context."""
    drafter = make_drafter(kind, builtin_target) if kind else None
    engine = Engine(builtin_target, drafter,
                    EngineConfig(kv_cache_bytes=builtin_target.kv_bytes_per_token * STEP_TOKENS))
    margin = drafter.num_draft_tokens + 1 if drafter is not None else 0
    assert engine.max_row_tokens == STEP_TOKENS - margin == engine.stats()["max_row_tokens"]
    prompt = [5] * 200
    tokens, reason, _ = run_alone(engine, prompt, SamplingParams(max_tokens=100))
    assert (tokens, reason) == SoloReference(builtin_target).tokens(prompt, SamplingParams(max_tokens=56 - margin))
    assert reason == "length" or len(tokens) < 56 - margin  # stopped at the row's end, or by EOS before it
    with pytest.raises(ValueError, match=rf"token_ids: a prompt of {STEP_TOKENS - margin} tokens does not fit this "
                                         rf"server's KV cache budget of 1 MiB, which holds {STEP_TOKENS - margin} "
                                         rf"tokens a request \(GMLX_KV_CACHE_MB\)"):
        engine.add_request([5] * (STEP_TOKENS - margin), SamplingParams(max_tokens=1))


def test_the_setting_sets_the_default_budget_and_zero_is_refused():
    with env_overrides({"GMLX_KV_CACHE_MB": "300"}):
        assert default_budget_bytes() == 300 << 20
    with env_overrides({"GMLX_KV_CACHE_MB": "0"}), pytest.raises(ValueError, match="GMLX_KV_CACHE_MB='0'"):
        default_budget_bytes()
    with env_overrides({"GMLX_KV_CACHE_MB": ""}):
        assert default_budget_bytes() > 0  # a share of the memory free now


def test_the_reserve_setting_is_read_at_start_and_a_bad_one_names_itself(builtin_target):
    with env_overrides({"GMLX_KV_RESERVE_TOKENS": ""}):
        assert Engine(builtin_target, None, EngineConfig()).stats()["kv_reserve_tokens"] == 256
    for bad in ("-1", "lots"):
        with env_overrides({"GMLX_KV_RESERVE_TOKENS": bad}), pytest.raises(ValueError, match="GMLX_KV_RESERVE_TOKENS"):
            Engine(builtin_target, None, EngineConfig())


def test_workers_started_together_split_the_default_budget(builtin_target):
    """`gmlx serve --workers N` starts each worker with --memory-sharers N: 1/N of the default
    each, taken by the engine once its model is loaded; a GMLX_KV_CACHE_MB setting is each
    worker's own."""
    command = WorkerSpec(num_memory_sharers=3).command("tcp://127.0.0.1:9")
    assert command[command.index("--memory-sharers") + 1] == "3"
    assert "--memory-sharers" not in WorkerSpec().command("tcp://127.0.0.1:9")
    with env_overrides({"GMLX_KV_CACHE_MB": ""}):
        whole = default_budget_bytes()
        third = Engine(builtin_target, None, EngineConfig(num_memory_sharers=3)).kv_budget.budget_bytes
    assert abs(3 * third - whole) < 0.05 * whole  # the memory free moves a little between the reads
    with env_overrides({"GMLX_KV_CACHE_MB": "300"}):
        assert default_budget_bytes(3) == 300 << 20


def _held_kv_bytes(engine) -> int:
    """The KV the engine holds: the batch, rows about to join, prompts part-prefilled."""
    held = [c for p in engine._ready for c in p.caches] + [c for cs in engine.queue._caches.values() for c in cs]
    held += engine.batch.caches if engine.batch is not None else []
    return sum(c.keys.nbytes + c.values.nbytes for c in held if c.keys is not None)


@pytest.mark.parametrize("kind", [None, "ngram", "mtp"])
def test_rows_past_the_budget_wait_and_every_stream_equals_plain(kind, builtin_target, code_prompts):
    """Random schedules under a budget of two of their widest rows: after every step the KV the
    engine holds (batch, rows about to join, prompts part-prefilled) is within the budget, some
    waiter was held back by it alone, and every stream equals its solo plain decoding."""
    reference = SoloReference(builtin_target)
    num_held, max_rows = 0, 0
    for seed in range(8):
        schedule = make_schedule(9100 + seed, builtin_target.vocab_size, code_prompts, max_requests=8)
        probe = KVBudget(builtin_target.kv_bytes_per_token, 1, margin_tokens=5)
        widest = max(probe.row_tokens(len(a.token_ids), a.params.max_tokens) for a in schedule.arrivals)
        budget_bytes = 2 * widest * builtin_target.kv_bytes_per_token
        drafter = make_drafter(kind, builtin_target) if kind else None
        engine = Engine(builtin_target, drafter, EngineConfig(kv_cache_bytes=budget_bytes))
        step = engine.step

        def checked_step():
            nonlocal num_held, max_rows
            outputs = step()
            assert _held_kv_bytes(engine) <= budget_bytes
            num_rows = (engine.batch.num_rows if engine.batch is not None else 0) + len(engine._ready)
            max_rows = max(max_rows, num_rows)
            num_held += bool(engine.queue) and num_rows < engine.config.max_num_rows and engine._num_free_rows() == 0
            return outputs

        engine.step = checked_step
        check_schedule(engine, reference, schedule)
    assert num_held > 0 and max_rows >= 2


def _two_long_requests(engine):
    """Two 200-token prompts asking 100 tokens each, the second sampled: under a budget of two
    256-token rows they both fit until the rows pass 256 tokens."""
    first = ([5 + (i * 7) % 300 for i in range(200)], SamplingParams(max_tokens=100))
    second = ([9 + (i * 11) % 300 for i in range(200)], SamplingParams(max_tokens=100, temperature=0.8, seed=3))
    ids = [engine.add_request(prompt, params) for prompt, params in (first, second)]
    tokens, stats, max_rows = {i: [] for i in ids}, {}, 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                stats[output.request_id] = output.stats
        max_rows = max(max_rows, 0 if engine.batch is None else engine.batch.num_rows)
    return [first, second], [tokens[i] for i in ids], [stats[i] for i in ids], max_rows


@pytest.mark.parametrize("prompt_cache_bytes", [0, 256 << 20])
def test_the_latest_arrival_is_evicted_when_rows_outgrow_the_budget_and_resumes_exactly(
        prompt_cache_bytes, builtin_target):
    """Reserving 8 tokens of growth, both rows join; at 256 tokens the buffers must double, the
    second arrival gives its row up, waits, is prefilled again with what it generated (from
    scratch, or its own KV back from the prompt cache) and goes on: both streams equal solo."""
    reference = SoloReference(builtin_target)
    budget_bytes = 2 * STEP_TOKENS * builtin_target.kv_bytes_per_token
    with env_overrides({"GMLX_KV_RESERVE_TOKENS": "8"}):
        engine = Engine(builtin_target, None, EngineConfig(kv_cache_bytes=budget_bytes,
                                                           prompt_cache_bytes=prompt_cache_bytes))
    requests, tokens, stats, max_rows = _two_long_requests(engine)
    assert max_rows == 2 and engine.counters["num_kv_evictions"] == 1
    assert [s["num_kv_evictions"] for s in stats] == [0, 1]
    assert stats[1]["cached_prompt_tokens"] == 0  # its own KV back is not a prompt-cache reuse
    for (prompt, params), got in zip(requests, tokens):
        assert got == reference.tokens(prompt, params)[0]
    evict = [e for e in engine.events if e["kind"] == "evict"]
    # When the first row holds 249 (8 short of the step), the second a few tokens behind it.
    assert len(evict) == 1 and 240 <= evict[0]["num_tokens"] <= 249


def test_reserving_all_a_row_may_generate_evicts_none(builtin_target):
    """GMLX_KV_RESERVE_TOKENS=0: each row reserves its whole max_tokens, so the second waits for
    the first to finish instead."""
    budget_bytes = 2 * STEP_TOKENS * builtin_target.kv_bytes_per_token
    with env_overrides({"GMLX_KV_RESERVE_TOKENS": "0"}):
        engine = Engine(builtin_target, None, EngineConfig(kv_cache_bytes=budget_bytes))
    _, _, stats, max_rows = _two_long_requests(engine)
    assert max_rows == 1 and engine.counters["num_kv_evictions"] == 0
    assert [s["num_kv_evictions"] for s in stats] == [0, 0]


def _long_schedule(seed: int, vocab_size: int, source: list[int]):
    """make_schedule's arrivals, switches and sampling, each prompt a 150-235-token cut of
    source text, up to 120 new tokens: rows that join narrow and grow past 256 tokens. Some
    penalize repeats or hold back end tokens, which an evicted row's prefill must count again."""
    schedule = make_schedule(seed, vocab_size, [], max_requests=6, max_new_tokens=120, penalty_rate=0.3,
                             end_rate=0.2)
    rng = random.Random(seed)

    def cut(arrival):
        start = rng.randrange(0, len(source) - 250)
        return dataclasses.replace(arrival, token_ids=tuple(source[start : start + rng.randint(150, 235)]))

    return dataclasses.replace(schedule, arrivals=tuple(cut(a) for a in schedule.arrivals))


@pytest.mark.parametrize("kind", [None, "ngram", "mtp"])
def test_random_schedules_past_the_budget_evict_and_every_stream_equals_plain(kind, builtin_target, code_prompts):
    """Random schedules of long prompts under a budget of three 256-token rows, reserving 8
    tokens of growth, prompt cache on and off: rows join, outgrow the budget and are evicted.
    After every step the KV the engine holds is within the budget, and every stream (cancels,
    temperatures, caps, preempts included) equals its solo plain decoding."""
    reference = SoloReference(builtin_target)
    source = [t for p in code_prompts for t in p]
    budget_bytes = 3 * STEP_TOKENS * builtin_target.kv_bytes_per_token
    num_evicted = 0
    for seed in range(8):
        schedule = _long_schedule(9400 + seed, builtin_target.vocab_size, source)
        drafter = make_drafter(kind, builtin_target) if kind else None
        with env_overrides({"GMLX_KV_RESERVE_TOKENS": "8"}):
            engine = Engine(builtin_target, drafter, EngineConfig(
                kv_cache_bytes=budget_bytes, prompt_cache_bytes=(256 << 20) * (seed % 2)))
        step = engine.step

        def checked_step(engine=engine, step=step):
            outputs = step()
            assert _held_kv_bytes(engine) <= budget_bytes
            return outputs

        engine.step = checked_step
        num_evicted += check_schedule(engine, reference, schedule).counters["num_kv_evictions"]
    assert num_evicted >= 3


def test_a_live_server_stops_a_request_at_a_row_and_refuses_a_longer_prompt():
    with env_overrides({"GMLX_KV_CACHE_MB": "1"}):  # the built-in model: 256 tokens a MiB
        server = Server(drafter="ngram")
    try:
        with Client(server.address, timeout_s=60) as client:
            max_row_tokens = client.stats()["max_row_tokens"]
            assert 240 < max_row_tokens < 256  # a row less the n-gram verify's margin
            with pytest.raises(RequestError, match="GMLX_KV_CACHE_MB"):
                list(client.generate(token_ids=[5] * 300, max_tokens=4))
            chunks = list(client.generate(token_ids=[5] * 200, max_tokens=100, temperature=0.0))
            assert sum(len(c.token_ids) for c in chunks) <= max_row_tokens - 200
            assert chunks[-1].finish_reason in ("length", "stop")
            assert client.stats()["kv_budget_bytes"] == 1 << 20
    finally:
        server.kill()


def test_a_live_server_evicts_the_later_of_two_growing_rows_and_both_streams_are_whole():
    """Over real sockets: a budget of two 256-token rows, 8 tokens of growth reserved; two
    clients at once send 150-token prompts asking 150 tokens. Both join, and some 100 tokens
    later the later arrival is evicted at the step and prefilled again: each stream equals the
    same request run alone after."""
    with env_overrides({"GMLX_KV_CACHE_MB": "2", "GMLX_KV_RESERVE_TOKENS": "8"}):
        server = Server(drafter="ngram")
    prompts = [[5 + (i * 7) % 300 for i in range(150)], [9 + (i * 11) % 300 for i in range(150)]]
    results: list = [None, None]

    def one(i):
        with Client(server.address, timeout_s=60) as client:
            chunks = list(client.generate(token_ids=prompts[i], max_tokens=150, temperature=0.8, seed=11 + i))
            results[i] = ([t for c in chunks for t in c.token_ids], chunks[-1].stats)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        with Client(server.address, timeout_s=60) as client:
            stats = client.stats()
            assert stats["num_kv_evictions"] >= 1 and stats["kv_reserve_tokens"] == 8
            for i, (tokens, _) in enumerate(results):
                alone = list(client.generate(token_ids=prompts[i], max_tokens=150, temperature=0.8, seed=11 + i))
                assert tokens == [t for c in alone for t in c.token_ids]
        assert sum(stats["num_kv_evictions"] for _, stats in results) >= 1
    finally:
        server.kill()

