"""Loading target and draft models through mlx-lm, split into body and head.

The engine needs the final hidden state (for the MTP head and captures) as well as the
logits, so a model is used as `body(tokens, cache) -> hidden` and `head(hidden) -> logits`.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gmlx.cache.ragged import stored_kv_dtype
from gmlx.config import (is_cpu_decode_ops_enabled, is_cpu_float_kernels_enabled, is_cpu_fusion_enabled,
                         is_cpu_kernels_enabled, is_fused_layers_enabled, is_input_major_enabled, kv_cache_dtype)
from gmlx.models.compute_format import FLOAT32, choose_cpu_compute_format
from gmlx.models.gguf import read_gguf
from gmlx.models.packed import use_packed_attention
from gmlx.models.source import is_gguf_path, resolve_model_path
from gmlx.platform.cpu_decode_ops import use_cpu_decode_ops
from gmlx.platform.cpu_float import use_float_kernels
from gmlx.platform.cpu_graph import fuse_cpu_ops
from gmlx.platform.cpu_layout import store_weights_input_major
from gmlx.platform.cpu_layers import use_fused_layers
from gmlx.platform.cpu_quantized import float16_groups, runs_int8_activations, use_cpu_kernels
from gmlx.platform.row_invariance import use_block_row_products, wanted_row_rules

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
    # Attention takes a PackedLayerCache (models/packed.py): prefill chunks ride decode forwards.
    is_packable: bool = False
    # Its layers run as fused kernel nodes over ragged caches (platform/cpu_layers.py), which a
    # packed forward cannot use: a round with prompt chunks runs them the fused way instead
    # (segments of the stack's one node, cpu_layers.segment_bodies).
    is_layer_fused: bool = False
    kv_bytes_per_token: int = 0  # one row's keys and values for one token, every layer, as stored
    # Its KV caches' element type (GMLX_KV_DTYPE, resolved at load); None: the type it computes in.
    kv_dtype: mx.Dtype | None = None
    num_weight_bytes: int = 0  # what one forward reads of weights, as loaded

    def forward(self, tokens: mx.array, cache) -> tuple[mx.array, mx.array]:
        hidden = self.body(tokens, cache)  # (B, T, D)
        return hidden, self.head(hidden)


def load_model(path: str | Path | None) -> LoadedModel:
    """Load an mlx-lm model folder or a GGUF file; ValueError naming the path when it is missing or broken."""
    source = resolve_model_path(path)
    k_quant_blocks = {}
    if is_gguf_path(source):
        model, tokenizer, config, k_quant_blocks = _load_gguf(source)
    else:
        model, tokenizer, config = _load_folder(source)
    is_tied = getattr(model, "lm_head", None) is None or config.get("tie_word_embeddings", False)
    is_cpu = mx.default_device() == mx.cpu
    num_fused_layers = _prepare_for_cpu(model, str(source), is_tied, k_quant_blocks) if is_cpu else 0
    row_rules = wanted_row_rules()
    if row_rules:
        use_block_row_products(model, str(source), row_rules.block_rows)
    is_packable = use_packed_attention(model, row_rules)
    if row_rules and not is_packable:
        logger.warning("model %s: its attention class is not one gmlx mirrors, so on this device a row's "
                       "attention may round differently in a batch or a verify than alone", source)
    mx.eval(model.parameters())
    body = model.model
    kv_dtype = stored_kv_dtype(is_int8_activations=any(runs_int8_activations(layer) for layer in body.layers))
    if kv_dtype is not None:
        logger.info("model %s: KV cache in %s (GMLX_KV_DTYPE=%s)", source, kv_dtype, kv_cache_dtype())
    head = body.embed_tokens.as_linear if is_tied else model.lm_head
    eos = set(tokenizer.eos_token_ids or ())
    if isinstance(config.get("eos_token_id"), int):
        eos.add(config["eos_token_id"])
    elif isinstance(config.get("eos_token_id"), list):
        eos.update(config["eos_token_id"])
    return LoadedModel(
        path=str(source),
        model=model,
        body=body,
        head=head,
        tokenizer=tokenizer,
        num_layers=len(body.layers),
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        max_context_tokens=int(config.get("max_position_embeddings") or 4096),
        eos_token_ids=frozenset(eos),
        is_packable=is_packable,
        is_layer_fused=num_fused_layers > 0 and not row_rules,  # row rules run every forward packed
        # Keys and values otherwise take the hidden states' type, the final norm's.
        kv_bytes_per_token=_kv_bytes_per_token(config, len(body.layers), kv_dtype or body.norm.weight.dtype),
        kv_dtype=kv_dtype,
        num_weight_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    )


def _kv_bytes_per_token(config: dict, num_layers: int, dtype: mx.Dtype) -> int:
    num_heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    return num_layers * 2 * num_kv_heads * head_dim * dtype.size


def _load_folder(folder: Path):
    config = _read_config(folder)
    _check_model_type(folder, config)
    import mlx_lm  # deferred: importing it is slow and pulls in transformers

    try:
        model, tokenizer = mlx_lm.load(str(folder))
    except Exception as exc:  # mlx-lm raises many kinds for a broken folder
        raise ValueError(f"model {folder}: failed to load ({type(exc).__name__}: {exc})") from exc
    return model, tokenizer, config


def _load_gguf(path: Path):
    """Build the mlx-lm model in memory from a GGUF's weights, as mlx-lm would from a folder; with
    its K-quant matrices' blocks by module name (GGUFModel.k_quant_blocks)."""
    import mlx_lm.utils
    from mlx_lm.tokenizer_utils import load as load_tokenizer_wrapper

    loaded = read_gguf(path)
    config = loaded.config
    _check_model_type(path, config)
    model_class, args_class = mlx_lm.utils._get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = model.sanitize(loaded.weights) if hasattr(model, "sanitize") else loaded.weights
    quantization = config.get("quantization")
    if quantization:
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda name, _module: quantization.get(name, f"{name}.scales" in weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ValueError(f"GGUF {path}: its tensors do not fit a {config['model_type']} model ({exc})") from exc
    for name, module in model.named_modules():  # what the CPU kernels may hold narrower (cpu_quantized)
        if name in loaded.matrix_kinds:
            module.gguf_kind = loaded.matrix_kinds[name]
    # mlx-lm picks its streaming detokenizer from a saved tokenizer.json; save to a scratch folder.
    with tempfile.TemporaryDirectory(prefix="gmlx-gguf-tokenizer-") as scratch:
        loaded.tokenizer.save_pretrained(scratch)
        tokenizer = load_tokenizer_wrapper(Path(scratch), eos_token_ids=config.get("eos_token_id"))
    logger.info("loaded GGUF %s: %s, %d layers, %s", path, config["model_type"], config["num_hidden_layers"],
                f"quantized ({quantization['bits']}-bit default)" if quantization else "float")
    return model, tokenizer, config, loaded.k_quant_blocks


def _head_module(model: nn.Module, is_tied: bool) -> nn.Module:
    """The module whose product gives the logits: the tied token table or the lm_head."""
    return model.model.embed_tokens if is_tied else model.lm_head


def _prepare_for_cpu(model: nn.Module, source: str, is_tied: bool, k_quant_blocks: dict) -> int:
    """The model's CPU compute format, kernels and fused ops; how many layers run fused.
    k_quant_blocks: a GGUF's K-quant blocks by module name (GGUFModel.k_quant_blocks)."""
    is_quantized = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules())
    halves = float16_groups(model)  # before the cast: the int8 path keeps them as they are
    # By id, each beside its module (as halves holds them), so that a replaced module's id cannot match.
    k_blocks_by_module = {id(m): (m, *k_quant_blocks[name]) for name, m in model.named_modules()
                          if name in k_quant_blocks}
    # float32 on CPU: 16-bit types bypass BLAS there and run several times slower.
    model.set_dtype(mx.float32)
    if is_quantized:
        compute_format, reason = choose_cpu_compute_format()
        if compute_format == FLOAT32:
            from mlx_lm.utils import dequantize_model

            dequantize_model(model)  # scales are float32 by now, so the float32 copy is exact
            halves.clear()  # the quantized modules it holds are gone from the model
            k_blocks_by_module.clear()
        logger.info("model %s: CPU compute format %s (%s)", source, compute_format, reason)
    if is_cpu_fusion_enabled():
        fuse_cpu_ops(model)
    num_kernel_modules = 0
    if is_cpu_kernels_enabled():
        head = _head_module(model, is_tied)  # after a dequantize, which makes a new token table
        num_kernel_modules = use_cpu_kernels(model, head, halves, k_blocks_by_module)
        if is_cpu_float_kernels_enabled():
            num_kernel_modules += use_float_kernels(model, head)
    if is_input_major_enabled():
        store_weights_input_major(model)  # the float32 weights the kernels did not take
    if num_kernel_modules > 0 and is_cpu_decode_ops_enabled():
        use_cpu_decode_ops(model)  # off mlx's bits already: its small ops as one node each too
        if is_fused_layers_enabled():
            return use_fused_layers(model)  # and a layer whose products all have packed weights, one node
    return 0


def _check_model_type(source: Path, config: dict) -> None:
    """ValueError naming what the engine cannot run, from the config alone (before seconds of loading)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model {source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    # The ragged batch cache keeps every position, so sliding-window layers (llama/mistral
    # `layer_types`) would fail on the first forward.
    layer_types = config.get("layer_types") or ()
    num_sliding = sum(1 for t in layer_types if isinstance(t, str) and "sliding" in t)
    if num_sliding:
        raise ValueError(f"model {source}: sliding-window attention is not supported "
                         f"({num_sliding} of {len(layer_types)} layers, "
                         f"window {config.get('sliding_window')}); use a model with full attention in every layer")


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
