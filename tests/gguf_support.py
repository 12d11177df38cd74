"""Writing small GGUF files for tests, the way llama.cpp's converter lays them out.

The weights come from a random mlx-lm model folder (tests/conftest.py's make_random_model_dir)
and the tokenizer from its tokenizer.json, so a test can load the GGUF with gmlx and compare it
with the folder loaded by mlx-lm.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from mlx.utils import tree_flatten

from gmlx.models.llama3_rope import factors_of

CHAT_TEMPLATE = (
    "{% for message in messages %}<|endoftext|>{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}"
)
_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_PARTS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(mlx_name: str) -> str:
    module, kind = mlx_name.rsplit(".", 1)
    if module in _TOP_PARTS:
        return f"{_TOP_PARTS[module]}.{kind}"
    _, _, layer, part = module.split(".", 3)  # model.layers.N.part
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's rotary halves (what gmlx must undo)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf_from_folder(folder: Path, out: Path, architecture: str | None = None,
                           quant_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                           end_of_turn_id: int | None = None, rope_scaling: dict | None = None,
                           types: dict | None = None) -> Path:
    """A GGUF of the mlx-lm folder's model: 2-D weights stored as `quant_type`, the rest F32;
    end_of_turn_id: an end-of-turn token (tokenizer.ggml.eot_token_id) besides its EOS;
    rope_scaling: the scaling the file says, in place of the folder's (for files mlx-lm cannot build);
    types: GGUF tensor name -> its type where it is not `quant_type` (mixed files, as llama.cpp writes)."""
    import mlx.core as mx
    import mlx_lm

    config = json.loads((folder / "config.json").read_text())
    architecture = architecture or config["model_type"]
    model, _ = mlx_lm.load(str(folder))
    model.set_dtype(mx.float32)
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    scaling = rope_scaling or config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # as llama.cpp's converter stores it: divisors, not the numbers
        divisors = factors_of(scaling, config["rope_theta"], config["head_dim"])
        writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    elif scaling.get("rope_type") in ("yarn", "longrope"):  # metadata: the type, factor and original context
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        for key, value in scaling.get("gguf_extras", {}).items():
            writer.add_float32(f"{architecture}.rope.scaling.{key}", value)
    _add_tokenizer(writer, folder)
    if end_of_turn_id is not None:
        writer.add_eot_token_id(end_of_turn_id)
    is_permuted = architecture in ("llama", "mistral")
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    for name, value in tree_flatten(model.parameters()):
        array = np.array(value)
        part = name.split(".", 3)[-1].rsplit(".", 1)[0] if name.startswith("model.layers.") else ""
        if is_permuted and part in heads:
            array = permute_rows(array, heads[part])
        tensor_type = (types or {}).get(gguf_name(name), quant_type)
        if array.ndim == 2 and tensor_type.name in _SCALE_BYTES:
            writer.add_tensor(gguf_name(name), random_blocks(array.shape, tensor_type, seed=len(name)),
                              raw_dtype=tensor_type)
        elif array.ndim == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Block types the gguf package cannot quantize into: where their float16 scale d (and dmin) lie
# in a block's bytes, and the largest |sub-block scale x level| d multiplies.
_SCALE_BYTES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
                "IQ4_XS": (0,)}
_LARGEST_STEPS = {"Q2_K": 15 * 3, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32, "IQ4_NL": 127,
                  "IQ4_XS": 32 * 127}


def random_blocks(shape: tuple, tensor_type: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """A (rows, columns) matrix of random K-quant or IQ4 blocks (levels, sub-block scales and mins
    all random) with small positive block scales: values within 0.05, a small model's weights'
    size, though no weight's values (the type has no quantizer here). Bytes (rows, blocks x
    block bytes)."""
    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rows, columns = shape
    assert columns % values_per_block == 0, (shape, tensor_type)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // values_per_block, block_bytes), dtype=np.uint8)
    for at in _SCALE_BYTES[tensor_type.name]:
        largest = 0.05 / _LARGEST_STEPS[tensor_type.name]
        scale = rng.uniform(largest / 4, largest, (rows, blocks.shape[1], 1)).astype(np.float16)
        blocks[..., at : at + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"]: added["id"] for added in spec["added_tokens"]}
    for content, index in specials.items():
        if index >= len(tokens):
            tokens.append(content)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    end = specials["<|endoftext|>"]
    writer.add_eos_token_id(end)
    writer.add_pad_token_id(end)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
