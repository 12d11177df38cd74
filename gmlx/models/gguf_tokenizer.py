"""A transformers fast tokenizer built from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json: the vocabulary, merges, token types, special ids and chat
template are metadata under llama.cpp's key names. transformers ships the converter from
those to a `tokenizers` backend; we hand it the metadata and wrap the result with the special
tokens and the chat template, so `apply_chat_template` works as it does for a hub folder.
This module does not import mlx: the front-end process builds its tokenizer here too.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# GGUF key (after "tokenizer.ggml.") -> the name transformers' converter reads it under.
_CONVERTER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
_SPECIAL_ID_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                    "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
# llama.cpp's default when a sentencepiece ("llama") vocabulary does not say.
_DEFAULT_ADD_BOS = {"llama": True}
# Pre-tokenizers llama.cpp runs as "each digit alone, then GPT-2's split" (llama-vocab.cpp);
# transformers' converter gives them GPT-2's split only, which merges spaces before a digit.
_DIGIT_SPLIT_PRES = ("smollm", "codeshell", "exaone", "minerva-7b", "mellum2")


def read_tokenizer_metadata(path: str | Path) -> dict:
    """The `general.architecture` and `tokenizer.*` metadata of a GGUF file, as Python values.

    Reads without mlx (gguf_check.read_table); ValueError naming the file when it is not a whole GGUF.
    """
    from gmlx.models.gguf_check import read_table

    metadata, _ = read_table(path)
    return {name: value for name, value in metadata.items()
            if name.startswith("tokenizer.") or name == "general.architecture"}


def make_tokenizer(metadata: dict, source: str = "GGUF"):
    """A `PreTrainedTokenizerFast` from GGUF metadata (plain Python values, keys as in the file)."""
    from tokenizers import pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{source}: no tokenizer in the metadata (tokenizer.ggml.tokens is missing)")
    fields = {name: metadata[f"tokenizer.ggml.{key}"] for key, name in _CONVERTER_KEYS.items()
              if f"tokenizer.ggml.{key}" in metadata}
    architecture = metadata.get("general.architecture", "")
    try:
        backend, _ = convert_gguf_tokenizer(architecture, fields)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{source}: cannot build its tokenizer ({exc})") from exc
    if fields.get("tokenizer_type") == "gpt2" and fields.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    tokens = fields["tokens"]
    special = {name: tokens[int(metadata[f"tokenizer.ggml.{key}"])]
               for name, key in _SPECIAL_ID_KEYS.items() if f"tokenizer.ggml.{key}" in metadata}
    is_bos_added = bool(metadata.get("tokenizer.ggml.add_bos_token",
                                     _DEFAULT_ADD_BOS.get(fields.get("tokenizer_type"), False)))
    is_eos_added = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if is_bos_added or is_eos_added:
        _add_bos_eos(backend, processors, special, tokens, is_bos_added, is_eos_added)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False, **special,
    )
    logger.debug("%s: tokenizer %s/%s, %d tokens, bos added: %s", source,
                 fields.get("tokenizer_type"), fields.get("pre_tokenizer_type"), len(tokens), is_bos_added)
    return tokenizer


def _add_bos_eos(backend, processors, special, tokens, is_bos_added, is_eos_added) -> None:
    # llama.cpp adds these at encode time; a post-processor makes `encode` do the same.
    ids = {token: index for index, token in enumerate(tokens)}
    bos, eos = special.get("bos_token"), special.get("eos_token")
    prefix = [bos] if is_bos_added and bos is not None else []
    suffix = [eos] if is_eos_added and eos is not None else []
    single = " ".join(prefix + ["$A"] + suffix)
    pair = " ".join(prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix)
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in dict.fromkeys(prefix + suffix)])


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of a GGUF file, read without mlx (the front-end's path)."""
    return make_tokenizer(read_tokenizer_metadata(path), source=f"GGUF {path}")
