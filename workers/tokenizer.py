"""The front-end's tokenizer: transformers' AutoTokenizer from the model folder, no mlx.

Detokenization runs once per row per round, decoding the request's recent tokens
(gmlx.textstream), so its per-call cost is the front-end's main cost. transformers' decode
spends ~10x longer in Python than the Rust decode under it; where it provably adds nothing
(a tokenizers backend, no clean-up pass) we call the backend directly.
"""

from __future__ import annotations

import logging
import random

logger = logging.getLogger(__name__)

_NUM_SELF_CHECKS = 64


class FastDecoder:
    """`decode(ids)` equal to `tokenizer.decode(ids)`, without transformers' overhead."""

    def __init__(self, tokenizer, backend):
        self._tokenizer = tokenizer
        self._backend = backend

    def decode(self, token_ids) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=False)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def load_tokenizer(model_path: str):
    """(tokenizer for encode, decoder for TextStream) of an mlx-lm model folder or a GGUF file."""
    if model_path.lower().endswith(".gguf"):  # the tokenizer lives in the GGUF's metadata
        from gmlx.models.gguf_tokenizer import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(model_path)
        return tokenizer, make_decoder(tokenizer)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer, make_decoder(tokenizer)


def make_decoder(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer  # a slow tokenizer, or one with a Python clean-up pass: keep it
    decoder = FastDecoder(tokenizer, backend)
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for _ in range(_NUM_SELF_CHECKS):  # belt and braces: both decodes must agree
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 48))]
        if decoder.decode(ids) != tokenizer.decode(ids):
            logger.info("the fast decode differs from transformers' here; using transformers'")
            return tokenizer
    return decoder


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for.

    A vocabulary entry's own spelling is never shorter than the text it decodes to (byte-level
    BPE spells a byte with one or two bytes, sentencepiece a space with three, byte fallback
    as <0xNN>), so its longest entry bounds any token."""
    vocab = tokenizer.get_vocab()
    return max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=1)
