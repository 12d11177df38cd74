"""An MTP head's draft vocabulary and its drafter's products in its target's format: drafts come
only from the vocabulary, a head file that disagrees with itself is refused by name, and
speculation with such a head still equals plain decoding."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gmlx.config import BUILTIN_MTP_DIR, EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models.draft_vocab import DRAFT_VOCAB_KEY, DraftVocabHead, make_draft_vocab_head
from gmlx.models.mtp_head import load_mtp_head, save_mtp_head
from gmlx.platform import cpu_kernels
from gmlx.request import SamplingParams
from gmlx.spec.calibration import _cache_key
from schedules import SoloReference, check_schedule, make_schedule, run_alone


def draft_ids(vocab_size: int, seed: int, share: float = 0.5) -> mx.array:
    rng = np.random.default_rng(seed)
    chosen = rng.choice(vocab_size, size=int(vocab_size * share), replace=False)
    return mx.array(np.sort(chosen).astype(np.int32))


def head_with_vocab(folder, ids, source=BUILTIN_MTP_DIR):
    head = load_mtp_head(source)
    save_mtp_head(head, head.args, folder, ids)
    return folder


def record_proposals(drafter) -> list:
    """Every (drafts, probs) the drafter proposes from now on, appended as it proposes them."""
    seen, propose = [], drafter.propose_with_probs

    def recording(batch, num_tokens, with_probs=True):
        seen.append(propose(batch, num_tokens, with_probs))
        return seen[-1]

    drafter.propose_with_probs = recording
    return seen


@pytest.fixture(scope="module")
def vocab_head_dir(builtin_target, tmp_path_factory):
    # The built-in model's most likely tokens are low ids; a random half keeps some of them out.
    return head_with_vocab(tmp_path_factory.mktemp("vocab_head"), draft_ids(builtin_target.vocab_size, 0))


def test_a_head_keeps_its_draft_vocabulary(vocab_head_dir, builtin_target):
    head = load_mtp_head(vocab_head_dir)
    assert np.array_equal(head.draft_token_ids, np.array(draft_ids(builtin_target.vocab_size, 0)))
    assert json.loads((vocab_head_dir / "config.json").read_text())["draft_vocab_size"] == builtin_target.vocab_size // 2
    assert "draft_token_ids" not in dict(head.parameters())  # not a weight: never trained nor saved as one
    assert load_mtp_head(BUILTIN_MTP_DIR).draft_token_ids is None


@pytest.mark.parametrize("ids, message", [
    (mx.array([5, 3, 9], dtype=mx.int32), "increasing"),
    (mx.array([3, 3, 9], dtype=mx.int32), "increasing"),
    (mx.array([3, 9, 4096], dtype=mx.int32), r"outside the vocabulary \[0, 2048\)"),
    (mx.array([[3, 9]], dtype=mx.int32), "1-D int32"),
    (mx.array([3.0, 9.0]), "1-D int32"),
])
def test_a_bad_draft_vocabulary_is_refused_by_name(tmp_path, ids, message):
    head = load_mtp_head(BUILTIN_MTP_DIR)
    with pytest.raises(ValueError, match=f"MTP head at {tmp_path}.*{message}"):
        save_mtp_head(head, head.args, tmp_path, ids)
    # The same ids written past the check are refused at load.
    save_mtp_head(head, head.args, tmp_path, mx.array([1, 2], dtype=mx.int32))
    weights = dict(mx.load(str(tmp_path / "model.safetensors")))
    weights[DRAFT_VOCAB_KEY] = ids
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = ids.size
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"MTP head at {tmp_path}.*{message}"):
        load_mtp_head(tmp_path)


def test_config_and_file_must_agree_on_the_draft_vocabulary(vocab_head_dir, tmp_path):
    config = json.loads((vocab_head_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((vocab_head_dir / "model.safetensors").read_bytes())
    for size in (None, 7):
        (tmp_path / "config.json").write_text(json.dumps(config | {"draft_vocab_size": size}))
        with pytest.raises(ValueError, match=f"MTP head at {tmp_path}: config.json says draft_vocab_size {size}"):
            load_mtp_head(tmp_path)


@pytest.mark.parametrize("target_name", ["builtin_target", "tiny_target", "tiny_quantized_target"])
def test_draft_vocab_logits_are_the_targets_on_its_tokens(target_name, request):
    """Tied (a token table's rows) and untied heads (float panels, quantized) alike."""
    target = request.getfixturevalue(target_name)
    ids = draft_ids(target.vocab_size, 1)
    head = make_draft_vocab_head(target, ids)
    assert isinstance(head, DraftVocabHead)
    hidden = mx.random.normal((3, 2, target.hidden_size), key=mx.random.key(3))
    logits, full = head(hidden), target.head(hidden)
    outside = np.ones(target.vocab_size, dtype=bool)
    outside[np.array(ids)] = False
    assert np.all(np.isneginf(np.array(logits)[..., outside]))
    # A quantized head's rows are quantized again at 8 bits, with int8 inputs in the kernels:
    # close, not equal.
    tolerance = 0.02 * mx.abs(full).max().item() if "quantized" in target_name else 1e-4
    assert mx.allclose(logits[..., ids], full[..., ids], rtol=1e-4, atol=tolerance).item()
    assert mx.array_equal(head.greedy(hidden), mx.argmax(logits, axis=-1)).item()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_with_a_draft_vocabulary_equals_plain(vocab_head_dir, builtin_target, code_prompts,
                                                          temperature):
    drafter = make_drafter(f"mtp:{vocab_head_dir}", builtin_target)
    engine = Engine(builtin_target, drafter, EngineConfig(is_adaptive_depth=False))
    reference = SoloReference(builtin_target)
    allowed = set(np.array(drafter.head.draft_token_ids).tolist())
    seen = record_proposals(drafter)
    for i, prompt in enumerate(code_prompts[:4]):
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=i)
        got, reason, _ = run_alone(engine, prompt, params)
        assert (got, reason) == reference.tokens(prompt, params)
    proposed = {token for drafts, _ in seen for token in np.array(drafts).ravel().tolist()}
    assert proposed and proposed <= allowed
    for seed in range(3):
        schedule = make_schedule(7700 + seed, builtin_target.vocab_size, code_prompts, max_requests=6)
        check_schedule(engine, reference, schedule)


def test_stochastic_drafts_report_no_mass_outside_the_vocabulary(vocab_head_dir, builtin_target, code_prompts):
    drafter = make_drafter(f"mtp:{vocab_head_dir}", builtin_target)
    engine = Engine(builtin_target, drafter, EngineConfig(is_adaptive_depth=False, is_stochastic_acceptance=True))
    seen = record_proposals(drafter)
    run_alone(engine, code_prompts[0], SamplingParams(max_tokens=24, temperature=0.8, seed=5))
    outside = np.ones(builtin_target.vocab_size, dtype=bool)
    outside[drafter.head.draft_token_ids] = False
    assert seen
    for drafts, probs in seen:
        assert probs is not None and np.all(np.array(probs)[..., outside] == 0)
        assert mx.allclose(probs.sum(-1), mx.ones(probs.shape[:-1]), atol=1e-5).item()


@pytest.mark.skipif(not cpu_kernels.is_built(), reason="the CPU kernels are not built")
def test_a_quantized_targets_head_runs_quantized_in_the_kernels(builtin_target):
    """On the CPU a quantized target's drafter products are quantized to its bits, in its kernels."""
    plain = load_mtp_head(BUILTIN_MTP_DIR)
    quantized = load_mtp_head(BUILTIN_MTP_DIR, (4, 32))
    assert quantized.layout.startswith("4-bit") and plain.layout.startswith("float32")
    assert not any(type(m) is nn.Linear for _, m in quantized.named_modules())
    reference = load_mtp_head(BUILTIN_MTP_DIR)  # the same quantization, in mlx's own products
    nn.quantize(reference, group_size=32, bits=4, class_predicate=lambda _, m: type(m) is nn.Linear)
    hidden = mx.random.normal((2, 1, builtin_target.hidden_size), key=mx.random.key(4))
    tokens = mx.array([[5], [17]])
    embed = builtin_target.body.embed_tokens
    want, got, exact = reference(hidden, tokens, embed), quantized(hidden, tokens, embed), plain(hidden, tokens, embed)
    # The kernels quantize each product's input rows to int8 too: within a few percent of mlx's.
    assert mx.linalg.norm(got - want).item() < 0.05 * mx.linalg.norm(want).item()
    assert mx.linalg.norm(got - exact).item() < 0.3 * mx.linalg.norm(exact).item()


def test_a_retrained_head_in_the_same_folder_is_calibrated_again(vocab_head_dir, builtin_target, tmp_path):
    folder = head_with_vocab(tmp_path / "head", draft_ids(builtin_target.vocab_size, 2))
    before = _cache_key(builtin_target, make_drafter(f"mtp:{folder}", builtin_target), 8)
    head_with_vocab(folder, draft_ids(builtin_target.vocab_size, 3))
    assert _cache_key(builtin_target, make_drafter(f"mtp:{folder}", builtin_target), 8) != before
