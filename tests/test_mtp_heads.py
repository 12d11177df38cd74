"""MTP heads shipped for a model file: found by the GGUF's sha256, refused for any other
model, and speculation with SmolLM2's head equal to plain decoding token for token."""

import json
import shutil

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models.head_registry import SHIPPED_HEADS_DIR, file_sha256, find_shipped_head
from gmlx.models.loader import load_model
from gmlx.models.source import smollm2_path
from gmlx.request import SamplingParams
from schedules import SoloReference, run_alone

try:
    SMOLLM2 = smollm2_path()
except ValueError as exc:  # the message says how to install it
    pytest.skip(f"SmolLM2 GGUF absent: {exc}", allow_module_level=True)

SMOLLM2_HEAD = SHIPPED_HEADS_DIR / "smollm2-135m-instruct-q4_1"
MAX_HEAD_BYTES = 10 * 1000 * 1000
PROMPTS = [
    "The GNU General Public License is a free, copyleft license for software and other kinds of works.",
    "def read_config(path):\n    \"\"\"Return the settings in the JSON file at path.\"\"\"\n",
]


@pytest.fixture(scope="module")
def tiny_gguf_target(tiny_llama_dir, tmp_path_factory):
    from gguf_support import write_gguf_from_folder

    return load_model(write_gguf_from_folder(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def retagged_head(tmp_path, sha256: str):
    """A copy of SmolLM2's head whose config claims another model file."""
    head = shutil.copytree(SMOLLM2_HEAD, tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    config["target_sha256"] = sha256
    (head / "config.json").write_text(json.dumps(config))
    return head


def test_smollm2_head_ships_tied_to_the_gguf_and_small():
    assert find_shipped_head(SMOLLM2) == SMOLLM2_HEAD
    config = json.loads((SMOLLM2_HEAD / "config.json").read_text())
    assert config["target_sha256"] == file_sha256(SMOLLM2) and config["target_name"] == SMOLLM2.name
    assert (SMOLLM2_HEAD / "model.safetensors").stat().st_size <= MAX_HEAD_BYTES


def test_a_head_for_another_model_is_refused(tiny_gguf_target, builtin_target):
    with pytest.raises(ValueError, match=f"distilled from {SMOLLM2.name}.*tiny.gguf is sha256"):
        make_drafter(f"mtp:{SMOLLM2_HEAD}", tiny_gguf_target)
    with pytest.raises(ValueError, match="a model folder, not a GGUF file"):
        make_drafter(f"mtp:{SMOLLM2_HEAD}", builtin_target)


def test_a_model_without_a_shipped_head_is_told_to_give_one(tiny_gguf_target):
    with pytest.raises(ValueError, match="no MTP head ships for .*tiny.gguf.*mtp:PATH"):
        make_drafter("mtp", tiny_gguf_target)


def test_a_head_tied_to_the_target_file_passes_the_checksum(tiny_gguf_target, tmp_path):
    # A copy claiming the tiny file's checksum gets past the tie; only its shape then differs.
    head = retagged_head(tmp_path, file_sha256(tiny_gguf_target.path))
    with pytest.raises(ValueError, match="head is for hidden 576"):  # past the checksum, the shape differs
        make_drafter(f"mtp:{head}", tiny_gguf_target)


@pytest.mark.slow
def test_speculation_with_the_shipped_head_equals_plain_on_smollm2(tmp_path):
    target = load_model("smollm2")
    with pytest.raises(ValueError, match="distilled from"):
        make_drafter(f"mtp:{retagged_head(tmp_path, '0' * 64)}", target)
    # Fixed depth: every round drafts, so every round exercises the head.
    engine = Engine(target, make_drafter("mtp", target), EngineConfig(is_adaptive_depth=False))
    reference = SoloReference(target)
    num_accepted = 0
    for i, text in enumerate(PROMPTS):
        prompt = target.tokenizer.encode(text)
        for temperature in (0.0, 0.8):
            params = SamplingParams(max_tokens=24, temperature=temperature, seed=i)
            got, reason, stats = run_alone(engine, prompt, params)
            assert (got, reason) == reference.tokens(prompt, params), (text, temperature)
            assert stats["num_drafted"] > 0
            num_accepted += stats["num_accepted"]
    assert num_accepted > 0  # the head drafts tokens the target keeps
