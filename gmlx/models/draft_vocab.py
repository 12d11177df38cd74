"""A head's draft vocabulary: the tokens an MTP head may draft, and the output product over only them.

An MTP draft ends in the target's output product over the whole vocabulary (SmolLM2: 49,152
rows, the larger half of a draft's time at one row). The tokens a model emits are a small share
of that, so a head trained for one model may ship the ids it drafts from, and the drafter
computes logits for those rows only. Drafts are proposals the verify accepts or replaces, so a
smaller draft vocabulary can make a draft impossible but never changes a decoded token.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from gmlx.platform.cpu_drafter_products import prepare_drafter_products, quantized_format

DRAFT_VOCAB_KEY = "draft_token_ids"  # its tensor in the head's safetensors file


def check_draft_vocab(ids: mx.array, vocab_size: int, where: str) -> None:
    """ValueError naming `where` unless ids are increasing int32 token ids in [0, vocab_size)."""
    if ids.dtype != mx.int32 or ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{where}: {DRAFT_VOCAB_KEY} must be a non-empty 1-D int32 array, "
                         f"got shape {tuple(ids.shape)} {ids.dtype}")
    # Increasing: no id twice, and a tie's first maximum is the same token over these rows as
    # over the whole vocabulary.
    if ids.size > 1 and not mx.all(ids[1:] > ids[:-1]).item():
        raise ValueError(f"{where}: {DRAFT_VOCAB_KEY} must be increasing token ids")
    if ids[0].item() < 0 or ids[-1].item() >= vocab_size:
        raise ValueError(f"{where}: {DRAFT_VOCAB_KEY} holds ids outside the vocabulary [0, {vocab_size})")


def _head_module(target) -> nn.Module:
    """The module whose product gives the logits: a tied token table (target.head is its bound
    as_linear) or the lm_head itself."""
    return getattr(target.head, "__self__", target.head)


def output_rows(target, ids: mx.array) -> mx.array:
    """The target's output-product rows (len(ids), D) for these tokens, in float32."""
    if _head_module(target) is target.body.embed_tokens:  # tied: the token table's rows, as looked up
        return target.body.embed_tokens(ids).astype(mx.float32)
    # Any other layout (panels, quads, mlx's own): the product of the identity is W.T, whatever
    # layout W is kept in; once, at load.
    return target.head(mx.eye(target.hidden_size, dtype=mx.float32)).T[ids].astype(mx.float32)


def _rows_format(target) -> tuple[int, int] | None:
    """(bits, group_size) the draft rows are quantized to: a quantized head's group size at 8 bits
    or more. Its rows come back as floats and are quantized again; at 4 bits the new grid can
    miss the old by half a step (4% of a logit on a test model), at 8 bits by 1/510 of a group's
    range."""
    head_format = quantized_format(_head_module(target))
    return None if head_format is None else (max(head_format[0], 8), head_format[1])


class DraftVocabHead(nn.Module):
    """hidden (B, T, D) -> logits (B, T, V): the target's logits on the draft vocabulary, -inf
    elsewhere, so the samplers and the stochastic acceptance see a full-vocabulary distribution
    that is the one the drafts were drawn from."""

    def __init__(self, target, ids: mx.array, rows: mx.array):
        super().__init__()
        self.ids = ids
        self.vocab_size = target.vocab_size
        self.product = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        self.product.weight = rows
        # A quantized target's head: these rows quantized again, in the same kernels.
        self.layout = prepare_drafter_products(self, _rows_format(target), is_head=True)
        mx.eval(self.parameters())

    def __call__(self, hidden: mx.array) -> mx.array:
        scores = self.product(hidden)  # (B, T, n)
        logits = mx.full((*scores.shape[:-1], self.vocab_size), -mx.inf, dtype=scores.dtype)
        logits[..., self.ids] = scores
        return logits

    def greedy(self, hidden: mx.array) -> mx.array:
        """The argmax of __call__'s logits, (B, T) int32, without spreading them over the vocabulary."""
        return self.ids[mx.argmax(self.product(hidden), axis=-1)]


class WholeVocabHead:
    """The target's own output product, with the same two calls as DraftVocabHead."""

    def __init__(self, head):
        self.head = head

    def __call__(self, hidden: mx.array) -> mx.array:
        return self.head(hidden)

    def greedy(self, hidden: mx.array) -> mx.array:
        return mx.argmax(self.head(hidden), axis=-1).astype(mx.int32)


def make_draft_vocab_head(target, ids: mx.array | None):
    """The drafter's output product: a DraftVocabHead over `ids`, or the target's whole head."""
    if ids is None:
        return WholeVocabHead(target.head)
    return DraftVocabHead(target, ids, output_rows(target, ids))
