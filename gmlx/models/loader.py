"""Loading target and draft models through mlx-lm, split into body and head.

The engine needs the final hidden state (for the MTP head and captures) as well as the
logits, so a model is used as `body(tokens, cache) -> hidden` and `head(hidden) -> logits`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from gmlx.config import (
    BUILTIN_TARGET_DIR,
    is_cpu_fusion_enabled,
    is_cpu_kernels_enabled,
    is_input_major_enabled,
)
from gmlx.platform.cpu_graph import fuse_cpu_ops
from gmlx.platform.cpu_layout import store_weights_input_major
from gmlx.platform.cpu_quantized import use_cpu_kernels

logger = logging.getLogger(__name__)

# Architectures whose layers all use a plain (non-windowed, non-recurrent) KV cache.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LoadedModel:
    path: str
    model: nn.Module
    body: Callable  # (tokens (B, T), cache) -> hidden (B, T, D)
    head: Callable  # hidden (..., D) -> logits (..., V)
    tokenizer: object  # mlx_lm TokenizerWrapper
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context_tokens: int
    eos_token_ids: frozenset[int]

    def forward(self, tokens: mx.array, cache) -> tuple[mx.array, mx.array]:
        hidden = self.body(tokens, cache)  # (B, T, D)
        return hidden, self.head(hidden)


def resolve_model_path(path: str | Path | None) -> Path:
    return BUILTIN_TARGET_DIR if path is None else Path(path).expanduser().resolve()


def load_model(path: str | Path | None) -> LoadedModel:
    """Load an mlx-lm model folder; ValueError naming the path when it is missing or broken."""
    folder = resolve_model_path(path)
    config = _read_config(folder)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model {folder}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    import mlx_lm  # deferred: importing it is slow and pulls in transformers

    try:
        model, tokenizer = mlx_lm.load(str(folder))
    except Exception as exc:  # mlx-lm raises many kinds for a broken folder
        raise ValueError(f"model {folder}: failed to load ({type(exc).__name__}: {exc})") from exc
    # float32 on CPU: 16-bit types bypass BLAS there and run several times slower.
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        if is_cpu_fusion_enabled():
            fuse_cpu_ops(model)
        if is_input_major_enabled():
            store_weights_input_major(model)
        if is_cpu_kernels_enabled():
            use_cpu_kernels(model)
    mx.eval(model.parameters())
    body = model.model
    if getattr(model, "lm_head", None) is not None and not config.get("tie_word_embeddings", False):
        head = model.lm_head
    else:
        head = body.embed_tokens.as_linear
    eos = set(tokenizer.eos_token_ids or ())
    if isinstance(config.get("eos_token_id"), int):
        eos.add(config["eos_token_id"])
    elif isinstance(config.get("eos_token_id"), list):
        eos.update(config["eos_token_id"])
    return LoadedModel(
        path=str(folder),
        model=model,
        body=body,
        head=head,
        tokenizer=tokenizer,
        num_layers=len(body.layers),
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        max_context_tokens=int(config.get("max_position_embeddings") or 4096),
        eos_token_ids=frozenset(eos),
    )


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ValueError(f"model {folder}: no such folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model {folder}: no config.json in the folder")
    try:
        return json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model {folder}: unreadable config.json ({exc})") from exc
