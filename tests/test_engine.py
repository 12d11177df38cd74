"""The engine core with plain decoding: equality with mlx-lm, batching, bad input."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

from gmlx.config import EngineConfig, env_overrides
from gmlx.engine import Engine
from gmlx.generate import stream_generate
from gmlx.models.loader import load_model
from gmlx.request import SamplingParams


def mlx_lm_tokens(model, target, token_ids, max_tokens):
    """mlx-lm's own generate on `model`, with the target's tokenizer, stopping at EOS like gmlx."""
    out = []
    sampler = make_sampler(temp=0.0)
    for response in mlx_stream_generate(model, target.tokenizer, mx.array(token_ids),
                                        max_tokens=max_tokens, sampler=sampler):
        if response.token in target.eos_token_ids:
            break
        out.append(response.token)
    return out


def run_alone(engine, token_ids, params):
    request_id = engine.add_request(token_ids, params)
    out, reason = [], None
    while reason is None:
        for output in engine.step():
            assert output.request_id == request_id
            out.extend(output.new_token_ids)
            reason = output.finish_reason
    return out, reason


# A greedy token may leave mlx-lm's only where mlx-lm's own top two logits are this close,
# relative to its largest |logit|: gmlx's CPU kernels sum in other orders than mlx and the BLAS.
NEAR_TIE_RTOL = 1e-3


def assert_equal_but_near_ties(reference, token_ids, got, expected):
    """got == expected, or they part where expected's token leads got's by a near-tie in the
    reference's own logits (and got's token is the reference's second)."""
    step = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if step is None:
        assert got == expected  # the same tokens, and both stopped at the same place
        return
    logits = reference(mx.array([token_ids + expected[:step]]))[0, -1]
    gap = (logits[expected[step]] - logits[got[step]]).item()
    second = int(mx.argsort(logits)[-2].item())
    assert got[step] == second and 0.0 <= gap <= NEAR_TIE_RTOL * mx.abs(logits).max().item(), (step, gap)


@pytest.mark.parametrize("which", ["builtin_target", "tiny_target", "tiny_quantized_target"])
def test_greedy_equals_mlx_lm_generate_but_at_near_ties(which, request, code_prompts, mlx_lm_reference):
    """The float32 models run on panels and the quantized one on the kernels' float path: other
    summation orders than mlx-lm's, so a greedy token may differ, but only at a near-tie."""
    target = request.getfixturevalue(which)
    if which == "tiny_quantized_target":
        # mlx's numerics (float activations); the int8 default may leave mlx-lm's path at
        # near-ties only (tests/test_smollm2.py checks that on the real model).
        with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "float"}):
            target = load_model(target.path)
    reference = mlx_lm_reference(target.path)
    engine = Engine(target, None, EngineConfig(prompt_cache_bytes=0))
    for token_ids in code_prompts[:20]:
        chunks = list(stream_generate(engine, params=SamplingParams(max_tokens=24), token_ids=token_ids))
        got = [t for c in chunks for t in c.token_ids]
        assert_equal_but_near_ties(reference, token_ids, got, mlx_lm_tokens(reference, target, token_ids, 24))
        assert chunks[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_staggered_batch_equals_alone(temperature, builtin_target, code_prompts):
    rng = random.Random(7)
    requests = [(code_prompts[i], SamplingParams(max_tokens=rng.randint(8, 40), temperature=temperature,
                                                 top_p=0.95 if temperature else 1.0, seed=100 + i))
                for i in range(8)]
    alone = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    expected = [run_alone(alone, p, s) for p, s in requests]

    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0, prefill_chunk_tokens=32))
    arrival_steps = sorted(rng.sample(range(30), 8))
    got, reasons, ids, step = {}, {}, {}, 0
    while len(reasons) < 8:
        for i, at in enumerate(arrival_steps):
            if at == step:
                ids[engine.add_request(*requests[i])] = i
        for output in engine.step():
            got.setdefault(ids[output.request_id], []).extend(output.new_token_ids)
            if output.finish_reason:
                reasons[ids[output.request_id]] = output.finish_reason
        step += 1
    assert engine.counters["num_plain_rounds"] > 0
    for i in range(8):
        assert (got[i], reasons[i]) == expected[i], f"request {i}"


@pytest.mark.parametrize(
    "token_ids, params, field",
    [
        ([], SamplingParams(), "token_ids"),
        ([1] * 5000, SamplingParams(), "token_ids"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-0.1), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(top_k=-1), "top_k"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
        ([1, 10**9], SamplingParams(), "token_ids"),
        ([1, 2], SamplingParams(speculate=1), "speculate"),
    ],
)
def test_bad_input_names_the_field_and_others_keep_going(token_ids, params, field, builtin_target, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    good = engine.add_request(code_prompts[0], SamplingParams(max_tokens=12))
    out = [t for o in engine.step() for t in o.new_token_ids]
    with pytest.raises(ValueError, match=field):
        engine.add_request(token_ids, params)
    reason = None
    while reason is None:
        for output in engine.step():
            assert output.request_id == good
            out.extend(output.new_token_ids)
            reason = output.finish_reason
    alone = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    assert (out, reason) == run_alone(alone, code_prompts[0], SamplingParams(max_tokens=12))


def test_unknown_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=str(missing)):
        load_model(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken"):
        load_model(broken)


def test_stop_string_ends_the_stream(builtin_target, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    full = "".join(c.text for c in stream_generate(engine, params=SamplingParams(max_tokens=40),
                                                    token_ids=code_prompts[1]))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop, "the model produced no text to stop on"
    chunks = list(stream_generate(engine, params=SamplingParams(max_tokens=40, stop=(stop,)),
                                  token_ids=code_prompts[1]))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert not engine.has_unfinished()


def test_cancel_leaves_other_rows_intact(builtin_target, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    keep = engine.add_request(code_prompts[2], SamplingParams(max_tokens=20, temperature=0.8, seed=3))
    drop = engine.add_request(code_prompts[3], SamplingParams(max_tokens=20))
    got, reasons = {keep: [], drop: []}, {}
    for _ in range(3):
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    engine.abort_request(drop)
    while keep not in reasons:
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
            if output.finish_reason:
                reasons[output.request_id] = output.finish_reason
    assert reasons[drop] == "cancelled"
    alone = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    assert got[keep] == run_alone(alone, code_prompts[2], SamplingParams(max_tokens=20, temperature=0.8, seed=3))[0]


def test_plain_decode_runs_no_forward_past_the_budget(builtin_target, code_prompts, monkeypatch):
    """The pipelined lookahead stops when no row has budget for it: a request of N tokens
    that ends by length costs its prefill and N - 1 one-position forwards, not N."""
    num_decode_forwards = 0
    real_forward = type(builtin_target).forward

    def counting_forward(self, tokens, cache):
        nonlocal num_decode_forwards
        num_decode_forwards += tokens.shape[1] == 1
        return real_forward(self, tokens, cache)

    monkeypatch.setattr(type(builtin_target), "forward", counting_forward)
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    for max_tokens, token_ids in zip([1, 2, 5, 17], code_prompts):
        num_decode_forwards = 0
        out, reason = run_alone(engine, token_ids, SamplingParams(max_tokens=max_tokens))
        assert reason == "length" and len(out) == max_tokens
        assert num_decode_forwards == max_tokens - 1
