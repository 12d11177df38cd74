"""Prompt lookup: propose the tokens that followed the last occurrence of the current n-gram."""

from __future__ import annotations

import mlx.core as mx

from gmlx.drafters.base import DEFAULT_WIDTH_CAP


class NgramDrafter:
    kind = "ngram"
    default_width_cap = DEFAULT_WIDTH_CAP
    needs_hidden = False
    has_distribution = False  # point proposals: exact-match acceptance only

    def __init__(self, num_draft_tokens: int | None = None, max_ngram: int = 3):
        self.num_draft_tokens = num_draft_tokens or 4
        self.max_ngram = max_ngram

    def reset(self) -> None:
        pass

    def add_rows(self, batch, rows, hidden) -> None:
        pass

    def keep_rows(self, rows) -> None:
        pass

    def on_verified(self, batch, num_accepted, hidden) -> None:
        pass

    def propose(self, batch, num_tokens: int) -> mx.array:
        drafts = [self._lookup(r.all_token_ids, num_tokens) for r in batch.requests]
        return mx.array(drafts, dtype=mx.int32)  # (B, k)

    def would_have_drafted(self, request) -> bool | None:
        tokens = request.all_token_ids
        return len(tokens) >= 2 and self._lookup(tokens[:-1], 1)[0] == tokens[-1]

    def _lookup(self, tokens: list[int], num_tokens: int) -> list[int]:
        # Row histories are all delivered tokens; the last one is the pending bonus.
        for size in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == suffix:
                    follow = tokens[start + size : start + size + num_tokens]
                    return follow + [follow[-1]] * (num_tokens - len(follow))
        return [tokens[-1]] * num_tokens
