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
        drafts = [self._lookup(r, r.all_token_ids, num_tokens) for r in batch.requests]
        return mx.array(drafts, dtype=mx.int32)  # (B, k)

    def would_have_drafted(self, request) -> bool | None:
        tokens = request.all_token_ids
        return len(tokens) >= 2 and self._lookup(request, tokens[:-1], 1)[0] == tokens[-1]

    def _lookup(self, request, tokens: list[int], num_tokens: int) -> list[int]:
        """scan_lookup's drafts from the request's n-gram index, brought up to `tokens` first."""
        index = request.drafter_memo
        if not isinstance(index, NgramIndex) or index.max_ngram != self.max_ngram:
            index = request.drafter_memo = NgramIndex(self.max_ngram)
        if not index.can_answer(len(tokens)):
            return scan_lookup(tokens, num_tokens, self.max_ngram)
        return index.lookup(tokens, num_tokens)


def scan_lookup(tokens: list[int], num_tokens: int, max_ngram: int) -> list[int]:
    """The drafts: what followed the last earlier occurrence of the longest suffix n-gram
    (n <= max_ngram) that occurred before, its last token repeated past the history's end;
    without one, the last token repeated. Row histories are all delivered tokens; the last
    one is the pending bonus."""
    for size in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return _padded(tokens[start + size : start + size + num_tokens], num_tokens)
    return [tokens[-1]] * num_tokens


def _padded(follow: list[int], num_tokens: int) -> list[int]:
    return follow + [follow[-1]] * (num_tokens - len(follow))


class NgramIndex:
    """Where each n-gram of a request's history last started, extended as the history grows
    (it only grows: delivered tokens are never taken back). scan_lookup walks the whole
    history for each lookup, ~50 us at 200 tokens without a match: at 4-16 rows that was a
    tenth of a fast model's round."""

    __slots__ = ("max_ngram", "_last_start", "_num_ends")

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self._last_start = [{} for _ in range(max_ngram + 1)]  # [n][n-gram] -> its last start
        self._num_ends = 0  # the n-grams ending before this position are in

    def can_answer(self, num_tokens: int) -> bool:
        """A lookup over a history of num_tokens needs every n-gram ending before its last
        token, and none ending there (the suffix itself): not one taken in for a longer one."""
        return num_tokens >= 1 and self._num_ends <= num_tokens - 1

    def lookup(self, tokens: list[int], num_tokens: int) -> list[int]:
        end = len(tokens) - 1
        for last in range(self._num_ends, end):  # n-grams ending at `last`, the latest start kept
            for size in range(1, min(self.max_ngram, last + 1) + 1):
                self._last_start[size][tuple(tokens[last - size + 1 : last + 1])] = last - size + 1
        self._num_ends = end  # can_answer: it was at most end
        for size in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self._last_start[size].get(tuple(tokens[-size:]))
            if start is not None:
                return _padded(tokens[start + size : start + size + num_tokens], num_tokens)
        return [tokens[-1]] * num_tokens
