"""Prompt chunks packed into the decode forward (gmlx/models/packed.py): each segment gets the
bits of a forward of its own, and every stream equals solo decoding while chunks ride the
plain and gated rounds of random schedules."""

import dataclasses
import random

import mlx.core as mx
import pytest

from gmlx.cache.ragged import RaggedKVCache, concat_layer_caches, make_ragged_cache
from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models.packed import Segment, packed_body, unpack
from gmlx.platform import cpu_kernels, cpu_layers
from gmlx.request import SamplingParams
from gmlx.spec import admission, prefill_pacing, staged_join
from schedules import SoloReference, check_schedule, make_schedule


# A prefill budget every packed chunk runs over, however little it costs.
_OVER_BUDGET_S = admission.MIN_PACKED_CHUNK_S / 2


def _prefilled(target, num_tokens: int, rng: random.Random):
    caches = make_ragged_cache(target.num_layers)
    tokens = mx.array([[rng.randrange(target.vocab_size) for _ in range(num_tokens)]], dtype=mx.int32)
    target.body(tokens, caches)
    mx.eval([c.keys for c in caches])
    return caches


def _random_tokens(target, num_rows: int, num_tokens: int, rng: random.Random) -> mx.array:
    return mx.array([[rng.randrange(target.vocab_size) for _ in range(num_tokens)] for _ in range(num_rows)],
                    dtype=mx.int32)


def _packed(target, segments):
    return unpack(packed_body(target.body, segments), segments)


def _stacked(target, segments):
    return cpu_layers.segment_bodies(target.body, segments)


def _count_stacked(monkeypatch) -> list[int]:
    """The segment count of every stacked forward over segments from now on."""
    counts = []
    forwards = cpu_layers._StackedModel.segment_forwards
    monkeypatch.setattr(cpu_layers._StackedModel, "segment_forwards",
                        lambda body, segments: counts.append(len(segments)) or forwards(body, segments))
    return counts


def _separate_and_packed(target, rng: random.Random, together=_packed):
    """One random case: decode rows (1-4 positions: a plain step or a verify) and one or two
    prompt chunks, each run alone and together (packed, or as segments of one stack node)."""
    lengths = [rng.randint(1, 70) for _ in range(rng.randint(1, 3))]
    batch = concat_layer_caches([_prefilled(target, n, rng) for n in lengths])
    arrivals = [_prefilled(target, rng.randint(1, 90), rng) for _ in range(rng.randint(1, 2))]
    pending = _random_tokens(target, len(lengths), rng.randint(1, 4), rng)
    chunks = [_random_tokens(target, 1, rng.randint(1, 20), rng) for _ in arrivals]
    alone = {"batch": concat_layer_caches([batch]), **{i: concat_layer_caches([a]) for i, a in enumerate(arrivals)}}
    _, logits = target.forward(pending, alone["batch"])
    chunk_hidden = [target.body(chunk, alone[i]) for i, chunk in enumerate(chunks)]
    packed = {"batch": concat_layer_caches([batch]), **{i: concat_layer_caches([a]) for i, a in enumerate(arrivals)}}
    segments = [Segment(pending, packed["batch"]), *(Segment(c, packed[i]) for i, c in enumerate(chunks))]
    decode_hidden, *packed_chunk_hidden = together(target, segments)
    packed_logits = target.head(decode_hidden)
    mx.eval(logits, chunk_hidden, packed_logits, packed_chunk_hidden)
    return (logits, chunk_hidden, alone), (packed_logits, packed_chunk_hidden, packed)


def _kv(caches) -> list[mx.array]:
    return [a[:, :, : c.size(), :] for c in caches for a in (c.keys, c.values)]


@pytest.mark.skipif(not cpu_kernels.is_built(), reason="gmlx's CPU kernels are not built here")
@pytest.mark.parametrize("which,together", [("tiny_quantized_target", _packed), ("gguf_like_target", _packed),
                                            ("tiny_target", _stacked), ("gguf_like_target", _stacked),
                                            ("builtin_target", _stacked)])
def test_packed_forward_gives_every_segment_its_own_bits_on_the_kernels(which, together, request, monkeypatch):
    """Packed, or as the segments of one stack node (the fused layers' way: float32 panels too,
    whose products are row-independent like the quads')."""
    target = request.getfixturevalue(which)
    assert target.is_packable
    num_stacked, num_segments = _count_stacked(monkeypatch), []
    rng = random.Random(7)
    for _ in range(6):
        (logits, hidden, alone), (packed_logits, packed_hidden, packed) = _separate_and_packed(target, rng, together)
        assert mx.array_equal(packed_logits, logits).item()
        assert all(mx.array_equal(p, h).item() for p, h in zip(packed_hidden, hidden, strict=True))
        num_segments.append(len(alone))
        for name in alone:
            assert alone[name][0].lengths == packed[name][0].lengths
            assert all(mx.array_equal(a, b).item() for a, b in zip(_kv(alone[name]), _kv(packed[name])))
    assert num_stacked == (num_segments if together is _stacked else [])


def test_packed_forward_on_float32_stays_within_the_products_rounding(builtin_target):
    # OpenBLAS's sgemm sums a row in an order that depends on the row count (blocks of 4),
    # so float32 rows may move in the last bits when packed, as in a wider verify.
    assert builtin_target.is_packable
    rng = random.Random(3)
    for _ in range(4):
        (logits, hidden, _), (packed_logits, packed_hidden, _) = _separate_and_packed(builtin_target, rng)
        assert mx.allclose(packed_logits, logits, atol=1e-4, rtol=1e-4).item()
        assert all(mx.allclose(p, h, atol=1e-4, rtol=1e-4).item() for p, h in zip(packed_hidden, hidden, strict=True))
        assert mx.array_equal(packed_logits.argmax(-1), logits.argmax(-1)).item()


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.mark.parametrize("is_layer_fused", [True, False])
@pytest.mark.parametrize("drafter_kind", ["none", "mtp"])
def test_streams_equal_solo_decoding_with_chunks_packed(builtin_target, reference, code_prompts, drafter_kind,
                                                        is_layer_fused, monkeypatch):
    """Chunks ride the rounds either way: with fused layers the round's rows and chunks are
    segments of one stack node (no packed body), else one packed forward runs them all."""
    from gmlx.spec import speculative

    assert builtin_target.is_layer_fused
    target = dataclasses.replace(builtin_target, is_layer_fused=is_layer_fused)
    num_packed_forwards, num_stacked = [], _count_stacked(monkeypatch)
    monkeypatch.setattr(speculative, "packed_body",
                        lambda body, segments: num_packed_forwards.append(1) or packed_body(body, segments))
    # A budget below the least a chunk is taken to cost keeps every packed chunk at its floor, so
    # prompts take several chunks.
    drafter = make_drafter(drafter_kind, target)
    engine = Engine(target, drafter, EngineConfig(prefill_budget_s=_OVER_BUDGET_S, is_prefill_packed=True))
    for seed in range(5):
        check_schedule(engine, reference, make_schedule(100 + seed, target.vocab_size, code_prompts))
    assert engine.counters["num_packed_chunks"] > 0
    assert bool(num_packed_forwards) != is_layer_fused
    assert bool(num_stacked) == is_layer_fused and all(n >= 2 for n in num_stacked)


def test_a_long_prompt_rides_the_running_rows_forwards(builtin_target, reference, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(prefill_budget_s=_OVER_BUDGET_S, is_prefill_packed=True))
    long_prompt = [t for p in code_prompts for t in p][:300]
    prompts = {"A": code_prompts[2], "B": long_prompt}
    params = {"A": SamplingParams(max_tokens=120), "B": SamplingParams(max_tokens=12, temperature=0.8, seed=4)}
    engine.add_request(prompts["A"], params["A"], request_id="A")
    got = {"A": [], "B": []}
    chunk_sizes, streaks = [], [0]
    for step in range(10_000):
        if step == 2:
            engine.add_request(prompts["B"], params["B"], request_id="B")
        before = engine.counters["num_packed_chunks"], engine.requests.get("B") and engine.requests["B"].num_prefilled
        outputs = engine.step()
        if engine.counters["num_packed_chunks"] > before[0]:
            chunk_sizes.append((engine.requests["B"].num_prefilled if "B" in engine.requests else 300) - before[1])
            streaks[-1] += 1
        elif streaks[-1]:
            streaks.append(0)
        for output in outputs:
            got[output.request_id].extend(output.new_token_ids)
        if not engine.has_unfinished():
            break
    assert len(chunk_sizes) >= 300 // admission.FIRST_BUDGETED_TOKENS, chunk_sizes
    # Each chunk runs over the budget: sizes halve to the floor and stay there.
    assert all(b <= a for a, b in zip(chunk_sizes, chunk_sizes[1:-1])), chunk_sizes
    assert chunk_sizes[-2] == admission.MIN_CHUNK_TOKENS, chunk_sizes
    # One round in PACKED_ROUNDS_PER_PLAIN runs plain, timing the yardstick a chunk is measured by.
    assert len(streaks) > 2 and max(streaks) <= prefill_pacing.PACKED_ROUNDS_PER_PLAIN, streaks
    for request_id in got:
        assert got[request_id] == reference.tokens(prompts[request_id], params[request_id])[0]


def test_a_request_cancelled_while_its_last_chunk_is_in_flight(builtin_target, reference, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(is_prefill_packed=True))
    params = SamplingParams(max_tokens=30)
    engine.add_request(code_prompts[0], params, request_id="A")
    got = []
    for _ in range(2):
        got += [t for o in engine.step() for t in o.new_token_ids]
    engine.add_request(code_prompts[1], SamplingParams(max_tokens=5), request_id="B")
    for output in engine.step():
        assert output.request_id == "A"
        got.extend(output.new_token_ids)
    assert [c.request.request_id for c in engine._landing] == ["B"]
    final = engine.abort_request("B")
    assert final is not None and final.finish_reason == "cancelled"
    b_outputs = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == "B":
                b_outputs.append(output)
            else:
                got.extend(output.new_token_ids)
    assert [o.finish_reason for o in b_outputs] == ["cancelled"], "B ends once, with no token after its cancel"
    assert got == reference.tokens(code_prompts[0], params)[0]


def test_packing_is_chosen_by_the_model_and_the_setting_overrides_it(builtin_target, monkeypatch):
    # The built-in model's layers are fused on the CPU: packed by default, though its weights are small.
    assert builtin_target.num_weight_bytes < prefill_pacing.PACKING_MIN_WEIGHT_BYTES
    assert Engine(builtin_target, None, EngineConfig()).is_prefill_packed is builtin_target.is_layer_fused
    monkeypatch.setenv("GMLX_PREFILL_PACKING", "0")
    engine = Engine(builtin_target, None, EngineConfig())
    assert Engine(builtin_target, None, EngineConfig(is_prefill_packed=True)).is_prefill_packed  # the config wins
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    engine.step()
    engine.add_request([8, 9, 10], SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert engine.counters["num_packed_chunks"] == 0 and engine.stats()["is_prefill_packed"] is False
    monkeypatch.setenv("GMLX_PREFILL_PACKING", "sometimes")
    with pytest.raises(ValueError, match="GMLX_PREFILL_PACKING"):
        Engine(builtin_target, None, EngineConfig())


@pytest.mark.parametrize("drafter_kind", ["none", "mtp"])
def test_long_joiners_are_staged_over_steps_and_every_stream_stays_exact(builtin_target, reference, code_prompts,
                                                                         monkeypatch, drafter_kind):
    # Every join staged (the threshold is for long rows on real models): streams equal solo decoding.
    monkeypatch.setattr(staged_join, "STAGED_JOIN_MIN_BYTES", 0)
    num_filled = []
    fill = RaggedKVCache.fill_leading_rows
    monkeypatch.setattr(RaggedKVCache, "fill_leading_rows", lambda self, source: (num_filled.append(1),
                                                                                   fill(self, source))[1])
    engine = Engine(builtin_target, make_drafter(drafter_kind, builtin_target),
                    EngineConfig(prefill_budget_s=_OVER_BUDGET_S, is_prefill_packed=True))
    for seed in range(10):
        check_schedule(engine, reference, make_schedule(200 + seed, builtin_target.vocab_size, code_prompts))
    assert num_filled, "no join was staged"


def test_a_staged_join_spreads_over_join_stages_steps(builtin_target, code_prompts, monkeypatch):
    monkeypatch.setattr(staged_join, "STAGED_JOIN_MIN_BYTES", 0)
    engine = Engine(builtin_target, None, EngineConfig(is_prefill_packed=True))
    engine.add_request(code_prompts[0], SamplingParams(max_tokens=60), request_id="A")
    engine.step()
    engine.add_request(code_prompts[1], SamplingParams(max_tokens=20), request_id="B")
    num_layers = builtin_target.num_layers
    layers_per_step = -(-num_layers // staged_join.JOIN_STAGES)
    num_staging_steps = -(-num_layers // layers_per_step)
    widths = []
    for _ in range(2 + num_staging_steps + 1):  # chunk, landing, staging steps, join
        engine.step()
        widths.append(engine.batch.num_rows)
    assert widths == [1] * (2 + num_staging_steps) + [2], widths
