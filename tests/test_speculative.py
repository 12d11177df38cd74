"""The two loops with every drafter: output equals plain decoding, width caps, gated rounds."""

import dataclasses

import mlx.core as mx
import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import SamplingParams
from schedules import SoloReference, check_schedule, make_schedule, run_alone

DRAFTERS = ("mtp", "draft", "ngram")
NUM_CHUNKS, SCHEDULES_PER_CHUNK = 7, 10  # 210 schedules in all
# The first chunk of schedules runs in the fast tier (pytest -m "not slow"), every chunk in the full run.
FAST_THEN_SLOW_CHUNKS = [0, *(pytest.param(c, marks=pytest.mark.slow) for c in range(1, NUM_CHUNKS))]


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.fixture(scope="module")
def engines(builtin_target):
    return {kind: Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
            for kind in DRAFTERS}


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_alone_equals_plain(kind, temperature, engines, reference, code_prompts):
    engine = engines[kind]
    for i, prompt in enumerate(code_prompts[:6]):
        params = SamplingParams(max_tokens=32, temperature=temperature, seed=i)
        got, reason, stats = run_alone(engine, prompt, params)
        assert (got, reason) == reference.tokens(prompt, params)
        assert stats["rounds_by_loop"].get("scalar", 0) > 0
        assert stats["num_drafted"] > 0


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("chunk", FAST_THEN_SLOW_CHUNKS)
def test_random_schedules_equal_plain(kind, chunk, engines, reference, code_prompts, monkeypatch):
    totals = {}
    for i in range(SCHEDULES_PER_CHUNK):
        seed = 1000 * DRAFTERS.index(kind) + chunk * SCHEDULES_PER_CHUNK + i
        schedule = make_schedule(seed, engines[kind].target.vocab_size, code_prompts, max_requests=8)
        result = check_schedule(engines[kind], reference, schedule)
        for key, value in result.counters.items():
            totals[key] = totals.get(key, 0) + value
    assert totals["num_spec_rounds"] > 0


@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_with_prompts_prefilled_apart_equal_plain(kind, builtin_target, reference, code_prompts):
    # The built-in model packs prompts into decode forwards by default; unfused and GPU models
    # (and GMLX_PREFILL_PACKING=0) prefill in forwards of their own, between rounds.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig(is_prefill_packed=False))
    for i in range(SCHEDULES_PER_CHUNK):
        schedule = make_schedule(15_000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8)
        check_schedule(engine, reference, schedule)
    assert engine.counters["num_packed_chunks"] == 0 and engine.counters["num_spec_rounds"] > 0


@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_on_a_float16_kv_cache_equal_plain(kind, builtin_target, code_prompts):
    """A float16 KV cache (GMLX_KV_DTYPE): every cache stores halves, each writer rounding as
    mlx's astype does, so speculative and batched streams still equal plain decoding's (itself on
    halves)."""
    target = dataclasses.replace(builtin_target, kv_dtype=mx.float16)
    engine = Engine(target, make_drafter(kind, target), EngineConfig())
    reference = SoloReference(target)
    engine.add_request(code_prompts[0][:20], SamplingParams(max_tokens=32))
    for _ in range(4):  # the prompt's prefill, then its first decode round
        engine.step()
        if engine.batch is not None:
            break
    assert engine.batch.caches[0].keys.dtype == mx.float16
    while engine.has_unfinished():
        engine.step()
    num_spec_rounds = 0
    for i in range(4):
        schedule = make_schedule(7000 + 10 * DRAFTERS.index(kind) + i, engine.target.vocab_size, code_prompts,
                                 max_requests=8)
        num_spec_rounds += check_schedule(engine, reference, schedule).counters["num_spec_rounds"]
    assert num_spec_rounds > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_greedy_batch_drafting_equals_plain(kind, builtin_target, reference, code_prompts):
    """The A/B alternative to coupled drafting: greedy drafts, sampled verification, still exact."""
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig(is_batch_draft_coupled=False))
    num_batch_rounds = 0
    for i in range(SCHEDULES_PER_CHUNK):
        schedule = make_schedule(5000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8)
        num_batch_rounds += check_schedule(engine, reference, schedule).counters.get("num_batch_rounds", 0)
    assert num_batch_rounds > 0


class PoisonedAfterGate:
    """Wraps a real drafter; once it is reset after holding rows (preempt or gate), any call raises."""

    def __init__(self, inner):
        self.inner = inner
        self.kind, self.needs_hidden = inner.kind, inner.needs_hidden
        self.num_draft_tokens, self.default_width_cap = inner.num_draft_tokens, inner.default_width_cap
        self.has_rows = self.is_poisoned = False

    def reset(self):
        # reset does no MLX work; after the first one that drops rows nothing may follow.
        self.is_poisoned = self.has_rows
        self.inner.reset()

    def _forward(name):
        def call(self, *args):
            if self.is_poisoned:
                raise AssertionError(f"drafter.{name} called while gated")
            self.has_rows = True
            return getattr(self.inner, name)(*args)
        return call

    add_rows, keep_rows = _forward("add_rows"), _forward("keep_rows")
    propose, on_verified = _forward("propose"), _forward("on_verified")


@pytest.mark.parametrize("kind", DRAFTERS)
def test_gated_rounds_do_no_drafter_work(kind, builtin_target, reference, code_prompts, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_MTP_RESUME", "0")  # the gate latches: every later round is gated
    drafter = PoisonedAfterGate(make_drafter(kind, builtin_target))
    # A big prefill budget admits all three waiters in one drain, straight over the cap; a fixed
    # depth keeps the lone stream speculating until they come (no depth gate before the cap's).
    engine = Engine(builtin_target, drafter, EngineConfig(prefill_chunk_tokens=4096, is_adaptive_depth=False))
    params = SamplingParams(max_tokens=24)
    first = engine.add_request(code_prompts[0], params)
    got = {first: []}
    for _ in range(3):  # the first request speculates alone
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    for prompt in code_prompts[1:4]:
        got[engine.add_request(prompt, params)] = []
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    assert drafter.is_poisoned and engine.counters["num_gated_rounds"] > 5
    assert engine.counters["num_preempts"] == 1
    for prompt, tokens in zip(code_prompts[:4], got.values()):
        assert tokens == reference.tokens(prompt, params)[0]


def test_draft_model_with_another_vocabulary_is_refused(tmp_path, builtin_target):
    from conftest import make_random_model_dir

    other = make_random_model_dir(tmp_path / "other", vocab_size=builtin_target.vocab_size + 7)
    with pytest.raises(ValueError, match="vocabulary"):
        make_drafter(f"draft:{other}", builtin_target)


def test_unknown_drafter_is_named(builtin_target):
    with pytest.raises(ValueError, match="medusa"):
        make_drafter("medusa", builtin_target)


class RecordingDrafter:
    """Wraps a real drafter and records, per propose call, which requests it drafted for."""

    def __init__(self, inner):
        self.inner = inner
        self.kind, self.needs_hidden = inner.kind, inner.needs_hidden
        self.num_draft_tokens, self.default_width_cap = inner.num_draft_tokens, inner.default_width_cap
        self.drafted_for: list[tuple[str, ...]] = []

    def propose(self, batch, num_tokens):
        self.drafted_for.append(tuple(r.request_id for r in batch.requests))
        return self.inner.propose(batch, num_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_opt_out_rows_never_draft_nor_hold_the_batch_back(kind, builtin_target, reference, code_prompts,
                                                          monkeypatch):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "1")  # only the opt-outs make this batch wider than the cap
    drafter = RecordingDrafter(make_drafter(kind, builtin_target))
    # Fixed depth: the one speculating row never rests at depth 0, so any gate would be the cap's.
    engine = Engine(builtin_target, drafter, EngineConfig(prefill_chunk_tokens=4096, is_adaptive_depth=False))
    requests = {"spec": (code_prompts[0], SamplingParams(max_tokens=30)),
                "out1": (code_prompts[1], SamplingParams(max_tokens=30, speculate=False)),
                "out2": (code_prompts[2], SamplingParams(max_tokens=24, temperature=0.8, seed=9, speculate=False))}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    got = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    assert drafter.drafted_for and all(ids == ("spec",) for ids in drafter.drafted_for)
    assert engine.counters["num_gated_rounds"] == 0 and engine.counters["num_batch_rounds"] > 0
    for request_id, (prompt, params) in requests.items():
        assert got[request_id] == reference.tokens(prompt, params)[0], request_id


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_with_opt_outs_equal_plain(kind, builtin_target, reference, code_prompts):
    # A fresh engine, and whole prompt chunks: which rounds speculate depends on the live depth
    # policy's history and on when rows join, so neither earlier tests nor the machine's speed may move it.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig(prefill_budget_s=0))
    totals = {}
    for i in range(SCHEDULES_PER_CHUNK):
        schedule = make_schedule(9000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size,
                                 code_prompts, max_requests=8, opt_out_rate=0.4)
        result = check_schedule(engine, reference, schedule)
        for key, value in result.counters.items():
            totals[key] = totals.get(key, 0) + value
    assert totals["num_spec_rounds"] > 0 and totals["num_drafted"] > 0


class RandomDepths:
    """A depth policy drawing every row's k in 0..k_max at random each round, so verify rounds
    mix depths far more than live acceptance would; records the depths of each round. A round
    where every row draws 0 gates the batch on a coin toss, else runs at depth 0 (as an
    evidence-graded round does: an n-gram batch's is a bare round, whose lookahead the next
    speculative round verifies first); a gated batch re-arms on a coin toss."""

    def __init__(self, engine, k_max, seed):
        import random

        self.engine, self.k_max, self.rng = engine, k_max, random.Random(seed)
        self.depths_by_round: dict[int, list[int]] = {}

    def round_depths(self, request_ids, num_plain_rows, evidence=None, is_pipelined=False):
        ks = [self.rng.randint(0, self.k_max) for _ in request_ids]
        if not any(ks) and self.rng.random() < 0.5:
            return None
        self.depths_by_round.setdefault(self.engine.counters["num_rounds"], []).extend(ks)
        return ks

    def observe(self, request_id, num_drafted, num_accepted, evidence_class=None):
        assert 0 <= num_accepted <= num_drafted <= self.k_max

    def observe_share(self, evidence_class):
        pass

    def pays_to_draft(self, request_ids, num_plain_rows):
        return self.rng.random() < 0.3

    def expected_gain(self, request_ids, num_plain_rows):
        return float("nan")  # no model of gain: it re-arms on a coin toss

    def rest(self, scored_id=None):
        pass

    def forget(self, request_id):
        pass

    def describe(self):
        return {"k_max": self.k_max}


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRAFTERS)
def test_ragged_depth_schedules_equal_plain(kind, builtin_target, reference, code_prompts):
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig(prefill_chunk_tokens=64))
    engine.policy.depth_policy = depths = RandomDepths(engine, k_max=4, seed=DRAFTERS.index(kind))
    for i in range(SCHEDULES_PER_CHUNK):
        schedule = make_schedule(12_000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8, opt_out_rate=0.2)
        check_schedule(engine, reference, schedule)
    num_ragged = sum(len(set(ks)) > 1 for ks in depths.depths_by_round.values())
    num_depth_0 = sum(not any(ks) for ks in depths.depths_by_round.values())
    assert num_ragged > 20 and num_depth_0 >= 3 and engine.counters["num_accepted"] > 0
    assert (engine.counters["num_bare_rounds"] > 0) == engine.drafter.drafts_past_pending
    assert engine.counters["num_depth_gates"] > 0 and engine.counters["num_resumes"] > 0


def test_adaptive_depth_stops_drafting_what_is_never_accepted(builtin_target, reference, code_prompts):
    """n-gram lookup on random-token prompts proposes tokens the model never picks: the row's
    depth falls to 0 after a few rounds and the batch decodes plain, pipelined (the depth gate),
    instead of paying for k drafts every round."""
    import random

    rng = random.Random(3)
    engine = Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())
    params = SamplingParams(max_tokens=40)
    prompt = [rng.randrange(builtin_target.vocab_size) for _ in range(16)]
    request_id = engine.add_request(prompt, params)
    got, depths = [], []
    while engine.has_unfinished():
        if engine.batch is not None:
            depths.append(engine.policy.depth_policy.depths([request_id])[0])
        for output in engine.step():
            got.extend(output.new_token_ids)
    assert got == reference.tokens(prompt, params)[0]
    assert depths[0] > 0 and 0 in depths
    assert engine.counters["num_depth_gates"] >= 1
    assert engine.counters["num_gated_rounds"] > engine.counters["num_rounds"] / 2
    assert engine.counters["num_drafted"] < 4 * engine.counters["num_rounds"] / 2


def test_fixed_depth_switch_drafts_k_every_round(builtin_target, reference, monkeypatch):
    """GMLX_ADAPTIVE_DEPTH=0 (the bench's fixed-speculation side): the same never-accepted drafts
    are paid for in every round, and nothing gates the lone stream."""
    import random

    monkeypatch.setenv("GMLX_ADAPTIVE_DEPTH", "0")
    rng = random.Random(3)
    drafter = make_drafter("ngram", builtin_target)
    engine = Engine(builtin_target, drafter, EngineConfig())
    params = SamplingParams(max_tokens=40)
    prompt = [rng.randrange(builtin_target.vocab_size) for _ in range(16)]
    got, _, _ = run_alone(engine, prompt, params)
    assert got == reference.tokens(prompt, params)[0]
    assert engine.counters["num_depth_gates"] == 0 and engine.counters["num_gated_rounds"] == 0
    assert engine.counters["num_drafted"] == drafter.num_draft_tokens * engine.counters["num_spec_rounds"]


def test_ngram_keeps_score_from_the_history_alone():
    from gmlx.drafters.ngram import NgramDrafter
    from gmlx.request import Request

    drafter = NgramDrafter()
    request = Request("r", [5, 6, 7, 8, 5, 6], SamplingParams(), 0)
    request.output_token_ids = [7]  # 5 6 -> 7 before: the lookup would have drafted it
    assert drafter.would_have_drafted(request) is True
    request.output_token_ids = [9]
    assert drafter.would_have_drafted(request) is False
    assert drafter.would_have_drafted(Request("s", [3], SamplingParams(), 0)) is False


def test_a_depth_gated_row_whose_text_turns_repetitive_re_arms(builtin_target, reference):
    """Random-token prompts give n-gram nothing to copy at first; the built-in model's greedy
    continuation then repeats itself, which the gated row's free score notices: the batch
    re-arms and speculates, and the stream is still plain decoding's."""
    import random

    engine = Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())
    totals = dict.fromkeys(("num_depth_gates", "num_resumes", "num_spec_rounds"), 0)
    for seed in range(4):
        rng = random.Random(seed)
        prompt = [rng.randrange(builtin_target.vocab_size) for _ in range(16)]
        params = SamplingParams(max_tokens=160)
        before = dict(engine.counters)
        tokens, _, _ = run_alone(engine, prompt, params)
        assert tokens == reference.tokens(prompt, params)[0]
        for key in totals:
            totals[key] += engine.counters[key] - before[key]
    assert totals["num_depth_gates"] > 0 and totals["num_resumes"] > 0, totals


def test_a_depth_gated_lone_stream_admits_waiters_with_preempt_off(builtin_target, reference, monkeypatch):
    """Preempt off keeps waiters out of a speculating lone stream; once its drafts stop paying it
    is a gated batch, which admits them at its boundary like any other (nothing to protect)."""
    import random

    monkeypatch.setenv("GMLX_MTP_PREEMPT", "0")
    rng = random.Random(3)
    engine = Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())
    prompts = {name: [rng.randrange(builtin_target.vocab_size) for _ in range(16)] for name in ("lone", "waiter")}
    params = SamplingParams(max_tokens=60)
    engine.add_request(prompts["lone"], params, request_id="lone")
    got = {"lone": [], "waiter": []}
    while engine.counters["num_depth_gates"] == 0:
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    engine.add_request(prompts["waiter"], params, request_id="waiter")
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
            if output.request_id == "waiter" and len(got["waiter"]) == 1:
                assert len(got["lone"]) < 60, "the waiter waited for the lone stream to finish"
    assert engine.counters["num_preempts"] == 0
    for name, prompt in prompts.items():
        assert got[name] == reference.tokens(prompt, params)[0], name


def test_ngram_index_drafts_what_the_scan_drafts():
    """The n-gram drafter's index against scan_lookup over random growing histories (a small
    vocabulary, so n-grams repeat), with the gated score's one-shorter history in between."""
    import random

    from gmlx.drafters.ngram import NgramDrafter, scan_lookup
    from gmlx.request import Request

    for seed in range(20):
        rng = random.Random(seed)
        drafter = NgramDrafter(max_ngram=rng.choice([1, 2, 3, 4]))
        request = Request("r", [rng.randrange(6) for _ in range(rng.randrange(1, 8))], SamplingParams(), 0)
        for _ in range(60):
            request.output_token_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 5)))
            history = request.all_token_ids
            for _ in range(rng.randrange(1, 3)):  # both at one length: the score after a round's drafts
                k = rng.randrange(1, 6)
                roll = rng.random()
                if roll < 0.3:
                    assert drafter.would_have_drafted(request) == (
                        scan_lookup(history[:-1], 1, drafter.max_ngram)[0][0] == history[-1])
                elif roll < 0.6:  # a round: the evidence, then the drafts, from one memoized lookup
                    drafts, size = scan_lookup(history, k + 1, drafter.max_ngram)
                    assert drafter.draft_evidence([request], [True]) == [size]
                    assert drafter.draft_evidence([request], [False]) == [size + drafter.max_ngram + 1]
                    assert drafter._current_lookup(request, k)[0][:k] == drafts[:k]  # what propose sends
                    assert drafter._current_lookup(request, k + 1)[0][1 : k + 1] == drafts[1:]  # past a lookahead
                else:
                    assert drafter._lookup(request, history, k) == scan_lookup(history, k, drafter.max_ngram)
