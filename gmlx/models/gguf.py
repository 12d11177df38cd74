"""Reading a GGUF file (llama.cpp's format) into an mlx-lm model's config, weights and tokenizer.

`mx.load` reads GGUF natively: F32/F16/BF16 as they are, Q4_0/Q4_1/Q8_0 as MLX affine triplets
(weight, scales, biases; group 32). It refuses some other types and silently turns the rest
(Q4_K, Q6_K) into float16, so a file holding any other type is read here instead (said in a
log line; its table by gguf_check.read_table, other types' values by the `gguf` package's
dequantizers): its blocks become triplets where they are affine grids
(gguf_blocks.py: Q4_0/Q4_1/Q8_0 as mx.load makes them, Q4_K at 4 bits, Q5_0/Q5_1/Q5_K and the
IQ4 types at 8), its other quantized matrices are requantized to MLX 8-bit (group 32), its float
tensors stay as stored and the rest become float16.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from gmlx.models import gguf_blocks
from gmlx.models.gguf_check import TensorEntry, check_gguf_structure, read_table
from gmlx.models.gguf_tokenizer import make_tokenizer
from gmlx.models.llama3_rope import scaling_of

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# llama.cpp's converter interleaves the rotary halves of Q and K rows for these ("normal" rope);
# mlx-lm's models expect the Hugging Face order, so the permutation is undone at load.
_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
# The types a GGUF stores as plain numbers (views of them as such); the rest as bytes of blocks.
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
# The tensor types mx.load keeps as they are (the quantized ones as MLX affine triplets, group 32).
_MX_LOAD_KEEPS = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"})
_END_TOKEN_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
# K-quant types whose blocks the CPU kernels can keep as they are (cpu_kernels.K_TILE_KINDS).
_K_TILE_KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Tensors that become config, not parameters: Llama 3's per-pair RoPE divisors (llama3_rope.py).
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)$")
_TOP_TENSOR = re.compile(r"^(\w+)\.(weight|bias|scales|biases)$")


@dataclass(frozen=True)
class GGUFModel:
    config: dict  # an mlx-lm config.json
    weights: dict  # mlx-lm parameter name -> array (quantized ones as weight/scales/biases)
    tokenizer: object  # transformers PreTrainedTokenizerFast with the chat template
    # mlx-lm module name -> (kind, blocks) of its K-quant matrix, Q2_K to Q6_K (numpy uint8 rows, mostly views
    # of the mapped file): the CPU kernels' K-tiles are packed from these (cpu_quantized._store_quads).
    k_quant_blocks: dict = dataclasses.field(default_factory=dict)
    # mlx-lm module name -> the GGUF type of each matrix read from its blocks (Q5_0, IQ4_XS, ...): the
    # CPU kernels keep some types' levels narrower than the triplets' 8 bits (cpu_quantized._narrow_layout).
    matrix_kinds: dict = dataclasses.field(default_factory=dict)


def read_gguf(path: str | Path) -> GGUFModel:
    """Config, weights and tokenizer of a GGUF file; ValueError naming the file when it is broken."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF {path}: no such file")
    types = check_gguf_structure(path)  # mx.load crashes on some corrupt headers instead of raising
    if not types <= _MX_LOAD_KEEPS:
        # mx.load refuses some types and turns others (Q4_K, Q6_K) into float16 without a word: 4x a
        # Q4_K file's bytes, and a float32 model on the CPU.
        raw_weights, metadata, raw_blocks, raw_kinds = _read_blocks(path, types, "types mx.load does not keep")
    else:
        raw_blocks, raw_kinds = {}, {}
        try:
            raw_weights, metadata = mx.load(str(path), return_metadata=True)
        except (RuntimeError, ValueError) as exc:
            raw_weights, metadata, raw_blocks, raw_kinds = _read_blocks(path, types, f"mlx said: {exc}")
    metadata = {key: _to_python(value) for key, value in metadata.items()}
    config = _make_config(path, metadata, raw_weights)
    weights = _rename_weights(path, config, raw_weights)
    config["quantization"] = _quantization_config(weights)
    if not config["quantization"]:
        del config["quantization"]
    tokenizer = make_tokenizer(metadata, source=f"GGUF {path}")
    # Renamed and their q and k rows unpermuted as the weights are (numpy's reshapes are mlx's).
    k_quant_blocks = {}
    for name, (kind, blocks) in raw_blocks.items():
        mlx_name, num_heads = _mlx_name(path, config, name)
        rows = blocks if num_heads is None else _unpermute_rows(blocks, num_heads)
        k_quant_blocks[mlx_name[: -len(".weight")]] = (kind, rows)
    matrix_kinds = {_mlx_name(path, config, name)[0][: -len(".weight")]: kind for name, kind in raw_kinds.items()}
    return GGUFModel(config=config, weights=weights, tokenizer=tokenizer, k_quant_blocks=k_quant_blocks,
                     matrix_kinds=matrix_kinds)


def write_mlx_lm_folder(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an mlx-lm model folder (config, safetensors, tokenizer) from a GGUF file."""
    loaded = read_gguf(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), loaded.weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(loaded.config, indent=2, sort_keys=True) + "\n")
    loaded.tokenizer.save_pretrained(str(out))
    return out


def _read_blocks(path: Path, types: frozenset[str], why: str) -> tuple[dict, dict, dict, dict]:
    """The file's weights and metadata read here (gguf_check.read_table, the blocks decoded by
    gguf_blocks, other types dequantized by the gguf package), where mx.load would not keep them
    (`why`, said in a log line); each K-quant (Q2_K to Q6_K) matrix's (kind, blocks as they lie in the
    file), by name; and the type of each matrix read from its blocks, by name."""
    import gguf

    metadata, tensors = read_table(path)  # checked against the file's size: views below stay inside it
    mapped = np.memmap(path, mode="r").view(np.ndarray)  # plain views: a memmap slice costs ~1.5 us more
    logger.warning("GGUF %s: tensor types %s (%s): reading them from their blocks: Q4_0/Q4_1/Q8_0 as "
                   "mx.load keeps them, Q4_K at 4 bits and Q5_0/Q5_1/Q5_K/IQ4_NL/IQ4_XS at 8 from their blocks, "
                   "other quantized matrices requantized to 8 bits (group 32), float tensors as stored, the rest "
                   "float16", path, ", ".join(sorted(types)), why)
    weights, k_quant_blocks, matrix_kinds = {}, {}, {}
    for tensor in tensors:
        shape = tensor.shape
        data = _tensor_data(mapped, tensor)
        dequantize = functools.partial(_dequantized, path, tensor.name, gguf.GGMLQuantizationType[tensor.kind])
        if tensor.kind not in _FLOAT_TYPES and len(shape) == 2 and shape[1] % gguf_blocks.GROUP_SIZE == 0:
            weights.update(gguf_blocks.matrix_triplets(tensor.name, tensor.kind, data, dequantize,
                                                       location=(path, tensor.offset)))
            matrix_kinds[tensor.name] = tensor.kind
            if tensor.kind in _K_TILE_KINDS:
                k_quant_blocks[tensor.name] = (tensor.kind, data)
        else:
            values = dequantize(data).reshape(shape)
            # Float tensors as stored, as mx.load keeps them (norms and qwen2's biases are F32 in
            # llama.cpp's files); others float16. The RoPE divisors are matched to a formula to 1e-4.
            dtype = _FLOAT_TYPES.get(tensor.kind, mx.float16)
            weights[tensor.name] = mx.array(values).astype(mx.float32 if tensor.name == _ROPE_FREQS else dtype)
    return weights, metadata, k_quant_blocks, matrix_kinds


def _tensor_data(mapped: np.ndarray, tensor: TensorEntry) -> np.ndarray:
    """A tensor's bytes in the mapped file as the gguf package's reader views them: values of the
    plain numeric types, else rows of bytes (blocks), outer dimensions first."""
    data = mapped[tensor.offset : tensor.offset + tensor.num_bytes]
    if tensor.kind in _PLAIN_DTYPES:
        return data.view(_PLAIN_DTYPES[tensor.kind]).reshape(tensor.shape)
    return data.reshape(*tensor.shape[:-1], -1)


def _dequantized(path: Path, name: str, tensor_type, data: np.ndarray) -> np.ndarray:
    """Blocks of tensor `name` (data: a slice of them) as float values, with the gguf package."""
    import gguf

    try:
        return gguf.quants.dequantize(data, tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF {path}: tensor {name} has type {tensor_type.name}, "
                         f"which the gguf package cannot dequantize") from exc


def _to_python(value):
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _make_config(path: Path, metadata: dict, raw_weights: dict) -> dict:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF {path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def field(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF {path}: metadata {arch}.{name} is missing")
        return value

    num_heads = int(field("attention.head_count"))
    hidden_size = int(field("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    config = {
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": int(field("block_count")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", num_heads)),
        "head_dim": int(field("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 4096)),
        "vocab_size": int(metadata.get(f"{arch}.vocab_size") or len(tokens)),
        "tie_word_embeddings": "output.weight" not in raw_weights,
        "attention_bias": "blk.0.attn_q.bias" in raw_weights,
        "mlp_bias": False,
    }
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        config["rope_scaling"] = _yarn_scaling(path, field, metadata, arch)
    elif scaling_type not in (None, "none"):  # llama.cpp would scale; running unscaled would be silently wrong
        raise ValueError(f"GGUF {path}: rope scaling {scaling_type!r} is not supported "
                         f"(supported: linear, yarn, and Llama 3's rope_freqs)")
    if _ROPE_FREQS in raw_weights:  # Llama 3.1+: the scaling as stored divisors, one per rotary pair
        divisors = raw_weights[_ROPE_FREQS].astype(mx.float32).reshape(-1).tolist()
        if 2 * len(divisors) != config["head_dim"]:
            raise ValueError(f"GGUF {path}: rope_freqs holds {len(divisors)} divisors for head dim "
                             f"{config['head_dim']} (expected {config['head_dim'] // 2})")
        scaling = scaling_of(divisors, config["rope_theta"], f"GGUF {path}")
        if scaling is not None:
            config["rope_scaling"] = scaling
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    # llama.cpp ends generation at end-of-turn and end-of-message tokens too (Llama 3 instruct
    # models end a turn with <|eot_id|>, which is not their EOS).
    end_ids = list(dict.fromkeys(int(metadata[f"tokenizer.ggml.{key}"]) for key in _END_TOKEN_KEYS
                                 if f"tokenizer.ggml.{key}" in metadata))
    if end_ids:
        config["eos_token_id"] = end_ids[0] if len(end_ids) == 1 else end_ids
    return config


def _yarn_scaling(path: Path, field, metadata: dict, arch: str) -> dict:
    """mlx-lm's `rope_scaling` for a YaRN file: llama.cpp's defaults (beta_fast 32, beta_slow 1,
    ext_factor 1, attention factor 1 + 0.1 ln(factor)) are mlx-lm's; a file that changes the
    last two, or a DeepSeek log multiplier, is refused by name rather than run otherwise."""
    for key, default in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_ext_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):
        value = metadata.get(f"{arch}.rope.scaling.{key}")
        if value is not None and float(value) != default and not (key == "yarn_ext_factor" and float(value) < 0):
            raise ValueError(f"GGUF {path}: YaRN with rope.scaling.{key} = {value} is not supported "
                             f"(only {default})")
    return {"rope_type": "yarn", "factor": float(field("rope.scaling.factor")),
            "original_max_position_embeddings": int(field("rope.scaling.original_context_length")),
            "beta_fast": float(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))}


def _rename_weights(path: Path, config: dict, raw_weights: dict) -> dict:
    weights = {}
    for name, value in raw_weights.items():
        if name == _ROPE_FREQS:
            continue  # in the config (_make_config)
        mlx_name, num_heads = _mlx_name(path, config, name)
        weights[mlx_name] = value if num_heads is None else _unpermute_rows(value, num_heads)
    return weights


def _mlx_name(path: Path, config: dict, name: str) -> tuple[str, int | None]:
    """A GGUF tensor's mlx-lm parameter name, and the heads its rows interleave (llama.cpp's q and k
    of a llama: _unpermute_rows undoes it) or None."""
    if (match := _LAYER_TENSOR.match(name)) is not None:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"GGUF {path}: tensor {name} has no place in a {config['model_type']} model")
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        is_permuted = config["model_type"] in _PERMUTED_QK_ARCHITECTURES and part in heads
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}", heads[part] if is_permuted else None
    if (match := _TOP_TENSOR.match(name)) is not None and match.group(1) in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[match.group(1)]}.{match.group(2)}", None
    raise ValueError(f"GGUF {path}: tensor {name} has no place in a {config['model_type']} model")


def _unpermute_rows(value: mx.array, num_heads: int) -> mx.array:
    # Rows of each head were stored as (pairs, 2); HF order is (2, pairs). Row-wise, so it
    # applies alike to float weights, packed quantized rows, their scales and biases.
    rows = value.shape[0]
    rest = value.shape[1:]
    per_head = rows // num_heads
    assert per_head * num_heads == rows and per_head % 2 == 0, (value.shape, num_heads)
    grouped = value.reshape(num_heads, per_head // 2, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(rows, *rest)


def _quantization_config(weights: dict) -> dict:
    """mlx-lm's `quantization` entry: the commonest bits, and the modules that differ (files mix 4 and 8)."""
    per_module = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed = weights[f"{module}.weight"]
        in_features = scales.shape[-1] * gguf_blocks.GROUP_SIZE
        per_module[module] = {"group_size": gguf_blocks.GROUP_SIZE, "bits": packed.shape[-1] * 32 // in_features}
    if not per_module:
        return {}
    counts = {}
    for params in per_module.values():
        counts[params["bits"]] = counts.get(params["bits"], 0) + 1
    default_bits = max(counts, key=counts.get)
    exceptions = {module: params for module, params in per_module.items() if params["bits"] != default_bits}
    return {"group_size": gguf_blocks.GROUP_SIZE, "bits": default_bits, **exceptions}
