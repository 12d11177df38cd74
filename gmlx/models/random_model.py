"""Random-weight mlx-lm models built from ModelArgs (no download), for tests and benchmarks.

One factory for every size: the tiny llama the tests decode, the ~120M qwen3 the CPU
benchmarks time. Folders get the built-in tokenizer, so the engine serves them as-is.
Needs mlx: call gmlx.platform.blas.ensure_fast_blas() first.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from gmlx.config import BUILTIN_TARGET_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def builtin_vocab_size() -> int:
    return json.loads((BUILTIN_TARGET_DIR / "config.json").read_text())["vocab_size"]


def tiny_config(model_type: str = "llama", **overrides) -> dict:
    """A 2-layer, 64-wide model over the built-in vocabulary: decodes in milliseconds."""
    config = dict(model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  vocab_size=builtin_vocab_size(), max_position_embeddings=512, rope_theta=10000.0,
                  tie_word_embeddings=False, head_dim=16)
    config.update(overrides)
    return config


def qwen3_config(num_params: int, hidden_size: int = 1024, intermediate_size: int = 3072,
                 vocab_size: int = 8192) -> dict:
    """A qwen3 of about num_params parameters, by its layer count."""
    heads, kv_heads, head_dim = hidden_size // 64, max(1, hidden_size // 128), 64
    per_layer = (2 * hidden_size * heads * head_dim + 2 * hidden_size * kv_heads * head_dim
                 + 3 * hidden_size * intermediate_size)
    num_layers = max(1, round((num_params - vocab_size * hidden_size) / per_layer))
    return dict(model_type="qwen3", hidden_size=hidden_size, num_hidden_layers=num_layers,
                intermediate_size=intermediate_size, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=vocab_size, max_position_embeddings=4096,
                rope_theta=1e6, tie_word_embeddings=True)


def make_random_model(config: dict, seed: int = 0):
    """The mlx-lm model of `config` with seeded random weights (float32)."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    return arch.Model(arch.ModelArgs.from_dict(config))


def make_random_model_dir(folder: Path, config: dict, seed: int = 0) -> Path:
    """An mlx-lm folder holding make_random_model(config, seed) and the built-in tokenizer;
    an existing folder is reused as it is."""
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    model = make_random_model(config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    copy_tokenizer(BUILTIN_TARGET_DIR, folder)
    return folder


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
