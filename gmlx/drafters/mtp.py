"""The MTP drafter: a head fed by the target's hidden state at each row's last verified position."""

from __future__ import annotations

import logging

import mlx.core as mx

from gmlx.drafters.base import ModelDrafter
from gmlx.sampling import probabilities, sample

logger = logging.getLogger(__name__)


class MTPDrafter(ModelDrafter):
    kind = "mtp"
    needs_hidden = True

    def __init__(self, path, target, num_draft_tokens: int | None = None):
        from gmlx.models.draft_vocab import make_draft_vocab_head
        from gmlx.models.head_registry import check_head_fits_target, read_head_identity
        from gmlx.models.mtp_head import load_mtp_head
        from gmlx.platform.cpu_drafter_products import quantized_format

        # Before the shape check: "distilled from another model" is the message that helps.
        check_head_fits_target(path, *read_head_identity(path), target.path)
        self.head = load_mtp_head(path, quantized_format(target.body.layers[0]))
        if self.head.args.hidden_size != target.hidden_size or self.head.args.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter mtp:{path}: head is for hidden {self.head.args.hidden_size} / vocab "
                f"{self.head.args.vocab_size}, target has {target.hidden_size} / {target.vocab_size}"
            )
        self.target = target
        ids = self.head.draft_token_ids
        # The target's output product, over the head's draft vocabulary when it ships one.
        self.output_head = make_draft_vocab_head(target, None if ids is None else mx.array(ids))
        self.path = str(path)  # part of the calibration's cache key
        logger.info("MTP head: %s", self.describe())
        self.num_draft_tokens = num_draft_tokens or 3
        self.hidden: mx.array | None = None  # (B, 1, D): each row's hidden behind its pending token

    def describe(self) -> dict:
        """What `gmlx doctor` shows of it: where the head is, how its products run, what it drafts from."""
        ids = self.head.draft_token_ids
        return {"kind": self.kind, "path": self.path, "products": self.head.layout,
                "draft_vocab_size": self.target.vocab_size if ids is None else int(ids.size)}

    def reset(self) -> None:
        self.hidden = None

    def add_rows(self, batch, rows, hidden) -> None:
        assert hidden is not None and hidden.shape[0] == len(rows)
        num_before = 0 if self.hidden is None else self.hidden.shape[0]
        assert rows == list(range(num_before, num_before + len(rows))), "rows join at the end"
        new = hidden[:, None, :]
        self.hidden = new if self.hidden is None else mx.concatenate([self.hidden, new])

    def keep_rows(self, rows) -> None:
        if self.hidden is not None:
            self.hidden = self.hidden[mx.array(rows, dtype=mx.int32)] if rows else None

    def propose(self, batch, num_tokens: int) -> mx.array:
        return self.propose_with_probs(batch, num_tokens, with_probs=False)[0]

    def propose_with_probs(self, batch, num_tokens: int, with_probs: bool = True):
        """Drafts (B, k) and, with_probs, the distributions (B, k, V) they were drawn from."""
        assert self.hidden is not None and self.hidden.shape[0] == batch.num_rows
        embed = self.target.body.embed_tokens
        hidden, token = self.hidden, batch.pending[:, None]  # (B, 1, D), (B, 1)
        positions = batch.positions(num_tokens, first_offset=1)  # draft j sits at KV length + j
        drafts, probs = [], []
        for j in range(num_tokens):
            hidden = self.head(hidden, token, embed)
            if batch.draft_sampling.is_all_greedy and not with_probs:
                token = self.output_head.greedy(hidden)  # (B, 1): no full-vocabulary logits
            else:
                logits = self.output_head(hidden)  # (B, 1, V)
                token = sample(logits, batch.draft_sampling, positions[:, j : j + 1])
            drafts.append(token)
            if with_probs:
                probs.append(probabilities(logits, batch.draft_sampling))
        return mx.concatenate(drafts, axis=1), (mx.concatenate(probs, axis=1) if with_probs else None)

    def on_verified(self, batch, num_accepted, hidden) -> None:
        rows = mx.arange(hidden.shape[0])
        accepted = mx.array(num_accepted, dtype=mx.int32)
        self.hidden = hidden[rows, accepted][:, None, :]
