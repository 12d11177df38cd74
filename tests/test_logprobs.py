"""Per-token logprobs (SamplingParams.logprobs): the same bits in every loop, width and
transition as plain decoding's, and the model's own distribution at each position."""

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmlx import logprobs
from gmlx.cache.ragged import make_ragged_cache
from gmlx.config import EngineConfig, env_overrides
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.platform import cpu_kernels
from gmlx.request import SamplingParams
from kernel_support import requires_kernels, supported_isas
from schedules import SoloReference, check_schedule, make_schedule, run_schedule

DRAFTERS = ("mtp", "draft", "ngram")


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_with_logprobs_equal_plain_bit_for_bit(kind, builtin_target, reference, code_prompts):
    # Half the requests ask (0, 1, 5 or 20 alternatives), among opt-outs, cancels and caps.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
    num_asked, num_spec_rounds = 0, 0
    for i in range(8):
        schedule = make_schedule(41_000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8, opt_out_rate=0.2, logprobs_rate=0.5)
        result = check_schedule(engine, reference, schedule)
        num_asked += sum(len(result.logprobs[j]) for j, a in enumerate(schedule.arrivals)
                         if a.params.logprobs is not None)
        num_spec_rounds += result.counters["num_spec_rounds"]
    assert num_asked > 100 and num_spec_rounds > 0


def test_logprobs_survive_kv_evictions(builtin_target, code_prompts):
    # A row evicted for the KV budget is prefilled again; its next token's logits then come
    # from that prefill, and every token's logprobs must still be plain decoding's.
    reference = SoloReference(builtin_target)
    source = [t for p in code_prompts for t in p]
    rng = random.Random(5)
    num_evicted = 0
    for seed in range(3):
        schedule = make_schedule(42_000 + seed, builtin_target.vocab_size, [], max_requests=6, max_new_tokens=120,
                                 logprobs_rate=1.0)
        arrivals = []
        for a in schedule.arrivals:
            start = rng.randrange(0, len(source) - 250)
            arrivals.append(dataclasses.replace(a, token_ids=tuple(source[start : start + rng.randint(150, 230)])))
        schedule = dataclasses.replace(schedule, arrivals=tuple(arrivals))
        with env_overrides({"GMLX_KV_RESERVE_TOKENS": "8"}):
            engine = Engine(builtin_target, make_drafter("ngram", builtin_target),
                            EngineConfig(kv_cache_bytes=3 * 256 * builtin_target.kv_bytes_per_token))
        num_evicted += check_schedule(engine, reference, schedule).counters["num_kv_evictions"]
    assert num_evicted > 0


def _model_logprobs(target, token_ids: list[int]) -> mx.array:
    """log-softmax (T, V) of one forward over token_ids: the independent side."""
    caches = make_ragged_cache(target.num_layers)
    _, logits = target.forward(mx.array([token_ids], dtype=mx.int32), caches)
    logits = logits[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_models_distribution(temperature, builtin_target, reference, code_prompts):
    """Each token's logprob, and its position's top alternatives, against the log-softmax of one
    forward over prompt and output (a prefill: the last bits may differ, so within 1e-4), at
    any temperature: logprobs are of the raw logits, before temperature and filters."""
    for i, prompt in enumerate(code_prompts[:4]):
        params = SamplingParams(max_tokens=12, temperature=temperature, top_k=20 if temperature else 0,
                                seed=i, logprobs=5)
        tokens, _ = reference.tokens(prompt, params)
        entries = reference.logprobs(prompt, params)
        assert len(entries) == len(tokens)
        expected = _model_logprobs(builtin_target, list(prompt) + tokens)[len(prompt) - 1 : -1]  # (N, V)
        for j, (token, entry) in enumerate(zip(tokens, entries)):
            row = expected[j]
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert len(entry.top) == 5
            top_lps = [lp for _, lp in entry.top]
            assert top_lps == sorted(top_lps, reverse=True)
            for token_id, lp in entry.top:
                assert lp == pytest.approx(row[token_id].item(), abs=1e-4)
            fifth = mx.sort(row)[-5].item()
            assert top_lps[-1] == pytest.approx(fifth, abs=1e-4)  # no likelier token left out
            if temperature == 0.0:
                assert entry.top[0] == (token, entry.logprob)


def test_prompt_logprobs_score_every_prompt_token_even_when_the_prompt_is_cached(builtin_target, code_prompts):
    """prompt_logprobs: positions 1.. of the prompt, each the model's logprob of that token after
    those before it (one forward over the prompt, within 1e-4), on the first output only, the
    same bits when the prompt cache holds the prompt (its prefix is prefilled anyway)."""
    engine = Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())
    prompt = list(code_prompts[1][:100])
    plain = SamplingParams(max_tokens=4)
    scored = SamplingParams(max_tokens=4, prompt_logprobs=3)
    outputs = []
    for params in (plain, scored, scored, plain):  # the first run leaves the prompt in the prompt cache
        request_id = engine.add_request(prompt, params)
        outputs.append([o for _ in range(50) for o in engine.step() if o.request_id == request_id])
    assert outputs[3][-1].stats["cached_prompt_tokens"] > 0  # a plain request takes the cached prefix
    outputs.pop()
    assert all(o.prompt_logprobs is None for o in outputs[0])
    firsts = [run[0].prompt_logprobs for run in outputs[1:]]
    assert firsts[0] == firsts[1] and all(o.prompt_logprobs is None for run in outputs[1:] for o in run[1:])
    assert outputs[2][-1].stats["cached_prompt_tokens"] == 0
    entries = firsts[0]
    assert len(entries) == len(prompt) - 1
    expected = _model_logprobs(builtin_target, prompt)  # (P, V): row p predicts token p + 1
    for position, entry in enumerate(entries, start=1):
        row = expected[position - 1]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        assert [lp for _, lp in entry.top] == pytest.approx(sorted(row.tolist(), reverse=True)[:3], abs=1e-4)


def test_stochastic_acceptance_logprobs_score_the_emitted_tokens(builtin_target, code_prompts):
    """Rejection sampling emits drafts that need not be the target's samples: each token's logprob
    is still the target's logprob of that token at its position."""
    engine = Engine(builtin_target, make_drafter("draft", builtin_target), EngineConfig(is_stochastic_acceptance=True))
    schedule = make_schedule(43_000, builtin_target.vocab_size, code_prompts, max_requests=4,
                             temperatures=(0.8,), logprobs_rate=1.0)
    result = run_schedule(engine, schedule)
    assert result.counters["num_accepted"] > 0
    for index, arrival in enumerate(schedule.arrivals):
        tokens, entries = result.tokens[index], result.logprobs[index]
        assert len(entries) == len(tokens)
        if not tokens:
            continue
        expected = _model_logprobs(builtin_target, list(arrival.token_ids) + tokens)[len(arrival.token_ids) - 1 : -1]
        got = mx.array([e.logprob for e in entries])
        want = mx.take_along_axis(expected, mx.array(tokens)[:, None], axis=-1)[:, 0]
        assert mx.allclose(got, want, atol=1e-4).item(), (got, want)


def test_no_logits_are_held_past_delivery(builtin_target, code_prompts):
    """A row keeps the logits of positions sampled and not yet delivered only: at most a verify's
    worth, whatever the request's length."""
    engine = Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())
    params = SamplingParams(max_tokens=60, logprobs=2)
    for prompt in code_prompts[:3]:
        engine.add_request(list(prompt), params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max([most, *(len(r.logprobs_by_position) for r in engine.requests.values())])
    assert 0 < most <= 2 + 8


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_are_refused_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name} must"):
        SamplingParams(**{name: value}).validate()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_logprobs_on_mlx_ops_equal_plain_bit_for_bit(kind, builtin_target, code_prompts, monkeypatch):
    # Without the CPU kernels (GMLX_CPU_KERNELS=0, or a GPU) logprobs come from mlx's own ops:
    # other bits than the kernel's, as exact with themselves.
    monkeypatch.setenv("GMLX_CPU_KERNELS", "0")
    assert not logprobs._has_kernel()
    assert "logprobs in mlx ops" in cpu_kernels.format_status(cpu_kernels.status())  # gmlx doctor says which
    reference = SoloReference(builtin_target)
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
    for i in range(3):
        check_schedule(engine, reference, make_schedule(44_000 + i, builtin_target.vocab_size, code_prompts,
                                                        max_requests=6, logprobs_rate=1.0))


def _ranked(row: list[float], num_top: int) -> list[int]:
    """The ids of row's num_top largest, largest first, ties by lower id."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:num_top]


@requires_kernels
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_rows=st.integers(1, 6), vocab=st.sampled_from([1, 7, 16, 33, 1000, 49152]), num_top=st.integers(1, 20),
       seed=st.integers(0, 2**16), num_ties=st.integers(0, 8))
def test_token_logprobs_kernel_rows_stand_alone_and_match_mlx(num_rows, vocab, num_top, seed, num_ties):
    """Each row's bits depend on that row alone (row count, threads, ISA); the chosen logprob is
    the float64 log-softmax within float32 rounding; the top ids are the largest, ties by lower id."""
    ext = cpu_kernels.extension()
    num_top = min(num_top, vocab)
    rng = random.Random(seed)
    rows = [[rng.gauss(0, 4) for _ in range(vocab)] for _ in range(num_rows)]
    for row in rows:  # exact ties, at the top and anywhere
        for _ in range(num_ties):
            row[rng.randrange(vocab)] = row[rng.randrange(vocab)] if rng.random() < 0.5 else max(row)
    logits = mx.array(rows, dtype=mx.float32)
    tokens = mx.array([rng.randrange(vocab) for _ in range(num_rows)], dtype=mx.int32)
    isa, num_threads = ext.isa(), ext.num_threads()
    try:
        runs = []
        for run_isa in supported_isas(ext):
            for threads in (1, 2):
                ext.set_isa(run_isa)
                ext.set_num_threads(threads)
                out = cpu_kernels.token_logprobs(logits, tokens, num_top)
                mx.eval(out)
                runs.append([np.array(a) for a in out])
        ext.set_isa(isa)
        alone = [cpu_kernels.token_logprobs(logits[r : r + 1], tokens[r : r + 1], num_top) for r in range(num_rows)]
    finally:
        ext.set_isa(isa)
        ext.set_num_threads(num_threads)
    for run in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(run, runs[0]))
    chosen, top_ids, top_lps = runs[0]
    for r, (c, ids, lps) in enumerate(alone):
        assert np.array_equal(np.array(c), chosen[r : r + 1]) and np.array_equal(np.array(ids), top_ids[r : r + 1])
        assert np.array_equal(np.array(lps), top_lps[r : r + 1])
    float_rows = np.array(logits).tolist()  # as float32 rounded them
    # Against float64: mlx's own logsumexp drifts up to ~1.5e-4 over 49,152 entries (a flaky
    # reference at this tolerance); the kernel's 16-lane sum stays within ~1e-5.
    x = np.array(logits).astype(np.float64)
    expected = x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))
    want = expected[np.arange(num_rows), np.array(tokens)]
    assert np.allclose(chosen, want, rtol=1e-5, atol=5e-5)
    for r in range(num_rows):
        assert top_ids[r].tolist() == _ranked(float_rows[r], num_top)
        assert np.allclose(top_lps[r], expected[r][top_ids[r]], rtol=1e-5, atol=5e-5)
    # A top entry's logprob is the chosen logprob of that token, to the bit.
    again = cpu_kernels.token_logprobs(logits, mx.array(top_ids[:, -1]), num_top)[0]
    assert np.array_equal(np.array(again), top_lps[:, -1])


def test_logprob_entries_decode_each_token_once_per_model(builtin_target):
    """A logprobs entry names up to 21 tokens: the front-end's TokenTexts decodes each id once for
    all its streams, and gives what decoding the id alone gives."""
    from gmlx.textstream import TokenTexts, logprob_entries

    class CountingDecoder:
        def __init__(self, tokenizer):
            self.tokenizer, self.num_calls = tokenizer, 0

        def decode(self, ids):
            self.num_calls += 1
            return self.tokenizer.decode(ids)

    decoder = CountingDecoder(builtin_target.tokenizer)
    texts = TokenTexts(decoder)
    pairs = [(-1.0, [(7, -1.0), (8, -2.0)]), (-0.5, [(8, -0.5), (7, -3.0)])]
    for _ in range(3):
        entries = logprob_entries(texts, [7, 8], pairs)
    assert decoder.num_calls == 2
    assert [e["token"] for e in entries] == [builtin_target.tokenizer.decode([7]), builtin_target.tokenizer.decode([8])]
    assert [t["token"] for t in entries[1]["top_logprobs"]] == [entries[1]["token"], entries[0]["token"]]
