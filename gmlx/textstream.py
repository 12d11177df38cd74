"""Incremental detokenization with stop strings, kept off the decode loop."""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # what a tokenizer yields for a cut UTF-8 sequence
# Tokens kept before the new ones when decoding: enough for a tokenizer's joins (a word's
# leading space, a clean-up rule's neighbour) to see what precedes them.
_CONTEXT_TOKENS = 8


class TextStream:
    """Turns a request's growing token list into text deltas and detects stop strings.

    Text that could still become the start of a stop string is held back until it can't,
    so the client never sees part of a stop string. The stop string itself is not emitted.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), token_texts: TokenTexts | None = None):
        self.tokenizer = tokenizer
        self.token_texts = token_texts or TokenTexts(tokenizer)  # shared by a model's streams where given
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._num_emitted_chars = 0
        self.is_stopped = False
        # The settled tokens' text, built by decoding a window of recent tokens only (re-decoding
        # the whole list made a request's detokenization quadratic): decode of the settled tokens
        # from _window_start on is _window_text.
        self._text = ""
        self._window_start = 0
        self._window_text = ""

    def add(self, token_ids) -> str:
        """Append tokens; returns the new text that is safe to show."""
        assert not self.is_stopped, "add() after a stop string matched"
        self._token_ids.extend(token_ids)
        text = self._current_text()
        if text.endswith(_INCOMPLETE):
            text = text[: len(text.rstrip(_INCOMPLETE))]
        stop_at = self._find_stop(text)
        if stop_at is not None:
            self.is_stopped = True
            end = stop_at
        else:
            end = len(text) - self._held_back(text)
        end = max(end, self._num_emitted_chars)
        delta = text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _current_text(self) -> str:
        """Every token's text: the settled text and what the newer tokens add, which settles
        them unless it ends in a cut UTF-8 sequence (the next token may complete it)."""
        window = self.tokenizer.decode(self._token_ids[self._window_start :])
        if not window.startswith(self._window_text):  # a join reached back past the window: start over
            self._text, self._window_start, self._window_text = "", 0, ""
            window = self.tokenizer.decode(self._token_ids)
        fresh = window[len(self._window_text) :]
        if fresh.endswith(_INCOMPLETE):
            return self._text + fresh
        self._text += fresh
        self._window_text = window
        num_tokens = len(self._token_ids)
        if num_tokens - self._window_start > 2 * _CONTEXT_TOKENS:
            start = num_tokens - _CONTEXT_TOKENS
            recent = self.tokenizer.decode(self._token_ids[start:])
            # Slide only where the recent tokens decode alone to the text's end; else keep the
            # longer window and try again next time.
            if self._text.endswith(recent):
                self._window_start, self._window_text = start, recent
        return self._text

    def add_until_stop(self, token_ids) -> tuple[list[int], str]:
        """Like add(), but keeps only the tokens up to the one that completes a stop string."""
        if not self._stop:
            return list(token_ids), self.add(token_ids)
        kept, deltas = [], []
        for token in token_ids:  # one at a time, so the stream ends exactly at the match
            kept.append(token)
            deltas.append(self.add([token]))
            if self.is_stopped:
                break
        return kept, "".join(deltas)

    def take(self, token_ids, is_final: bool = False) -> tuple[list[int], str]:
        """A round's tokens and text to deliver: add_until_stop(), plus the held-back tail
        when these are the request's last tokens. The one place a stream's end is decided;
        `is_stopped` then tells whether a stop string ended it."""
        kept, text = self.add_until_stop(token_ids)
        if is_final and not self.is_stopped:
            text += self.flush()
        return kept, text

    def flush(self) -> str:
        """The held-back tail, once the request ended without a stop string."""
        if self.is_stopped:
            return ""
        text = self._current_text()
        delta = text[self._num_emitted_chars :]
        self._num_emitted_chars = len(text)
        return delta

    def _find_stop(self, text: str) -> int | None:
        if not self._stop:
            return None
        # Only text that is new since the last emit, plus room for a match to straddle it.
        start = max(0, self._num_emitted_chars - max(len(s) for s in self._stop))
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TokenTexts:
    """Each token's own text, decoded alone (a piece of a UTF-8 sequence decodes to U+FFFD), once
    per token: a logprobs entry names up to 21 tokens, ~30-60 us of decodes on every chunk."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def logprob_entries(token_texts: TokenTexts, token_ids, logprobs) -> list[dict]:
    """The wire's logprobs entries ({token_id, token, logprob, top_logprobs}) of token_ids, from a
    (logprob, [(token id, logprob), ...]) pair per token."""
    return [{"token_id": token_id, "token": token_texts(token_id), "logprob": logprob,
             "top_logprobs": [{"token_id": i, "token": token_texts(i), "logprob": lp} for i, lp in top]}
            for token_id, (logprob, top) in zip(token_ids, logprobs)]
