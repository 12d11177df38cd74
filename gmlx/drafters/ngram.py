"""Prompt lookup: propose the tokens that followed the last occurrence of the current n-gram.

The matched n-gram's size is the round's evidence (draft_evidence): on SmolLM2's held-out prose
and code, greedy, first drafts were kept in 0% of rounds without a match, 23-34% after a 1-gram,
51-63% after a 2-gram and 88-92% after a 3-gram (BENCHMARKS.md, session 28), so the depth policy
weighs each row's drafts by its evidence class this round (spec/depth.py)."""

from __future__ import annotations

import mlx.core as mx

from gmlx.drafters.base import DEFAULT_WIDTH_CAP


class NgramDrafter:
    kind = "ngram"
    default_width_cap = DEFAULT_WIDTH_CAP
    needs_hidden = False
    has_distribution = False  # point proposals: exact-match acceptance only
    drafts_past_pending = True  # drafts from the delivered history alone, so bare rounds may run

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
        # A row whose pending token is an undelivered lookahead: the lookup's first draft is the
        # guess of that token, and its drafts are what follows the guess.
        drafts = [self._current_lookup(r, num_tokens + 1)[0][skip : skip + num_tokens]
                  for r, skip in zip(batch.requests, _num_guessed(batch.is_delivered))]
        return mx.array(drafts, dtype=mx.int32)  # (B, k)

    def draft_evidence(self, requests, is_delivered: list[bool]) -> list[int]:
        """Each row's evidence class this round: the size of the n-gram its drafts follow (0:
        none); past an undelivered pending token, another class of the same size (those drafts
        also need the guess of that token to be right)."""
        return [self._current_lookup(r, self.num_draft_tokens + 1)[1] + skip * (self.max_ngram + 1)
                for r, skip in zip(requests, _num_guessed(is_delivered))]

    def would_have_drafted(self, request) -> bool | None:
        tokens = request.all_token_ids
        return len(tokens) >= 2 and self._lookup(request, tokens[:-1], 1)[0][0] == tokens[-1]

    def _current_lookup(self, request, num_tokens: int) -> tuple[list[int], int]:
        """The lookup over the request's whole history, at least num_tokens drafts: made once a
        round (the evidence asks before the drafts do); a padded lookup's prefix is the shorter one."""
        tokens = request.all_token_ids
        memo = getattr(request.drafter_memo, "last_lookup", None)
        if memo is not None and memo[0] == len(tokens) and len(memo[1]) >= num_tokens:
            return memo[1], memo[2]
        drafts, size = self._lookup(request, tokens, max(num_tokens, self.num_draft_tokens))
        request.drafter_memo.last_lookup = (len(tokens), drafts, size)  # histories only grow
        return drafts, size

    def _lookup(self, request, tokens: list[int], num_tokens: int) -> tuple[list[int], int]:
        """scan_lookup's drafts and match size from the request's n-gram index, brought up to `tokens` first."""
        index = request.drafter_memo
        if not isinstance(index, NgramIndex) or index.max_ngram != self.max_ngram:
            index = request.drafter_memo = NgramIndex(self.max_ngram)
        if not index.can_answer(len(tokens)):
            return scan_lookup(tokens, num_tokens, self.max_ngram)
        return index.lookup(tokens, num_tokens)


def _num_guessed(is_delivered: list[bool]) -> list[int]:
    """Per row, how many of the lookup's drafts guess tokens already dispatched (1 past a lookahead)."""
    return [0 if d else 1 for d in is_delivered]


def scan_lookup(tokens: list[int], num_tokens: int, max_ngram: int) -> tuple[list[int], int]:
    """The drafts: what followed the last earlier occurrence of the longest suffix n-gram
    (n <= max_ngram) that occurred before, its last token repeated past the history's end;
    without one, the last token repeated. With them, that n-gram's size (0: none). Row histories
    are all delivered tokens; the last one is the pending bonus."""
    for size in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return _padded(tokens[start + size : start + size + num_tokens], num_tokens), size
    return [tokens[-1]] * num_tokens, 0


def _padded(follow: list[int], num_tokens: int) -> list[int]:
    return follow + [follow[-1]] * (num_tokens - len(follow))


class NgramIndex:
    """Where each n-gram of a request's history last started, extended as the history grows
    (it only grows: delivered tokens are never taken back). scan_lookup walks the whole
    history for each lookup, ~50 us at 200 tokens without a match: at 4-16 rows that was a
    tenth of a fast model's round."""

    __slots__ = ("max_ngram", "_last_start", "_num_ends", "last_lookup")

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.last_lookup: tuple[int, list[int], int] | None = None  # (history length, drafts, size)
        self._last_start = [{} for _ in range(max_ngram + 1)]  # [n][n-gram] -> its last start
        self._num_ends = 0  # the n-grams ending before this position are in

    def can_answer(self, num_tokens: int) -> bool:
        """A lookup over a history of num_tokens needs every n-gram ending before its last
        token, and none ending there (the suffix itself): not one taken in for a longer one."""
        return num_tokens >= 1 and self._num_ends <= num_tokens - 1

    def lookup(self, tokens: list[int], num_tokens: int) -> tuple[list[int], int]:
        end = len(tokens) - 1
        for last in range(self._num_ends, end):  # n-grams ending at `last`, the latest start kept
            for size in range(1, min(self.max_ngram, last + 1) + 1):
                self._last_start[size][tuple(tokens[last - size + 1 : last + 1])] = last - size + 1
        self._num_ends = end  # can_answer: it was at most end
        for size in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self._last_start[size].get(tuple(tokens[-size:]))
            if start is not None:
                return _padded(tokens[start + size : start + size + num_tokens], num_tokens), size
        return [tokens[-1]] * num_tokens, 0
