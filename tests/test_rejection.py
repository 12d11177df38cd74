"""Stochastic acceptance (opt-in): the output distribution is the target's, greedy stays exact."""

import mlx.core as mx
import pytest

from conftest import make_random_model_dir
from gmlx.cache.ragged import make_ragged_cache
from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models.loader import load_model
from gmlx.models.draft_vocab import DraftVocabHead
from gmlx.models.mtp_head import MTPHead, MTPHeadArgs, save_mtp_head
from gmlx.request import SamplingParams
from schedules import SoloReference, check_schedule, make_schedule

PROMPT = [1, 2, 3, 4]
EOS = "eos"  # the sequence had already ended before this position
NUM_SAMPLES = 3000
CHI2_CRITICAL_16_DOF = 39.25  # p = 0.001


def next_probs(model, prefixes, temperature):
    """p(next | prefix) for each prefix, straight from the model (not through gmlx's sampler)."""
    _, logits = model.forward(mx.array(prefixes, dtype=mx.int32), make_ragged_cache(model.num_layers, len(prefixes)))
    return mx.softmax(logits[:, -1, :].astype(mx.float32) / temperature, axis=-1).tolist()


def marginals(model, eos_id, temperature):
    """Exact distributions of the 2nd and 3rd sampled tokens (EOS counted as the end)."""
    vocab = model.vocab_size
    p1 = next_probs(model, [PROMPT], temperature)[0]
    firsts = [t for t in range(vocab) if t != eos_id]
    p2_given = dict(zip(firsts, next_probs(model, [PROMPT + [t] for t in firsts], temperature)))
    pairs = [(a, b) for a in firsts for b in range(vocab) if b != eos_id]
    p3_given = dict(zip(pairs, next_probs(model, [PROMPT + list(p) for p in pairs], temperature)))
    second = {EOS: p1[eos_id]} | {v: sum(p1[a] * p2_given[a][v] for a in firsts) for v in range(vocab)}
    third = {EOS: p1[eos_id] + sum(p1[a] * p2_given[a][eos_id] for a in firsts)}
    third |= {v: sum(p1[a] * p2_given[a][b] * p3_given[(a, b)][v] for a, b in pairs) for v in range(vocab)}
    return second, third


def chi_square(counts, expected_probs, num):
    return sum((counts.get(k, 0) - num * p) ** 2 / (num * p) for k, p in expected_probs.items())


DRAFT_VOCAB = [0, 2, 3, 5, 8, 9, 11, 14]  # an MTP head's draft vocabulary: half of the 16 tokens


def random_mtp_head_dir(folder, target):
    """An untrained MTP head for the 16-token target, drafting from DRAFT_VOCAB only."""
    args = MTPHeadArgs(hidden_size=target.hidden_size, vocab_size=target.vocab_size, intermediate_size=128)
    mx.random.seed(3)
    head = MTPHead(args)
    mx.eval(head.parameters())
    save_mtp_head(head, args, folder, mx.array(DRAFT_VOCAB, dtype=mx.int32))
    return folder


@pytest.fixture(scope="module", params=["draft", "mtp"])
def small_vocab_pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab16")
    target = load_model(make_random_model_dir(folder / "target", seed=1, vocab_size=16))
    weights = (make_random_model_dir(folder / "draft", seed=2, vocab_size=16) if request.param == "draft"
               else random_mtp_head_dir(folder / "mtp", target))
    drafter = make_drafter(f"{request.param}:{weights}", target, num_draft_tokens=2)
    assert request.param == "draft" or isinstance(drafter.output_head, DraftVocabHead)
    return target, drafter


@pytest.mark.slow
def test_stochastic_acceptance_samples_the_target_distribution(small_vocab_pair, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "0")  # every row speculates, 64 at a time
    target, drafter = small_vocab_pair
    (eos_id,) = target.eos_token_ids
    temperature = 1.0
    engine = Engine(target, drafter, EngineConfig(prompt_cache_bytes=0, is_adaptive_depth=False,
                                                  is_stochastic_acceptance=True, prefill_chunk_tokens=4096))
    ids = {engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=temperature, seed=s)): s
           for s in range(NUM_SAMPLES)}
    sequences = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            sequences[output.request_id].extend(output.new_token_ids)
            if output.finish_reason == "stop":
                sequences[output.request_id].append(eos_id)
    seconds, thirds = {}, {}
    for seq in sequences.values():
        second = seq[1] if len(seq) > 1 else EOS
        third = seq[2] if len(seq) > 2 else EOS
        seconds[second] = seconds.get(second, 0) + 1
        thirds[third] = thirds.get(third, 0) + 1
    drafted, accepted = engine.counters["num_drafted"], engine.counters["num_accepted"]
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both acceptance and the residual were exercised

    p_second, p_third = marginals(target, eos_id, temperature)
    assert chi_square(seconds, p_second, NUM_SAMPLES) < CHI2_CRITICAL_16_DOF
    assert chi_square(thirds, p_third, NUM_SAMPLES) < CHI2_CRITICAL_16_DOF
    if drafter.kind == "draft":
        # The test can fail: the same samples are far from what the draft model alone would give.
        q_second, q_third = marginals(drafter.draft, eos_id, temperature)
        assert chi_square(seconds, q_second, NUM_SAMPLES) > 3 * CHI2_CRITICAL_16_DOF
    else:
        # Tokens the head can never draft still come out at the target's rate: the residual carries them.
        outside = [t for t in range(target.vocab_size) if t not in DRAFT_VOCAB and t != eos_id]
        assert sum(seconds.get(t, 0) for t in outside) > 0.1 * NUM_SAMPLES


def test_stochastic_acceptance_keeps_greedy_rows_exact(builtin_target, code_prompts):
    """With p and q one-hot, min(1, p/q) is exact matching and the residual is the target's argmax."""
    reference = SoloReference(builtin_target)
    for kind in ("mtp", "draft"):
        engine = Engine(builtin_target, make_drafter(kind, builtin_target),
                        EngineConfig(prefill_chunk_tokens=64, is_stochastic_acceptance=True))
        for i in range(4):
            schedule = make_schedule(30_000 + i, builtin_target.vocab_size, code_prompts, max_requests=6,
                                     temperatures=(0.0,), opt_out_rate=0.2)
            check_schedule(engine, reference, schedule)
        assert engine.counters["num_accepted"] > 0
