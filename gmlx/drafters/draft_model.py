"""A separate small draft model with its own ragged KV, kept one token behind the target."""

from __future__ import annotations

import mlx.core as mx

from gmlx.cache.ragged import concat_layer_caches, make_ragged_cache
from gmlx.models.loader import load_model
from gmlx.drafters.base import ModelDrafter
from gmlx.sampling import probabilities, sample

_PREFILL_CHUNK_TOKENS = 512


class DraftModelDrafter(ModelDrafter):
    kind = "draft"
    needs_hidden = False

    def __init__(self, path, target, num_draft_tokens: int | None = None):
        self.draft = load_model(path)
        self.path = str(path)  # part of the calibration's cache key
        if self.draft.vocab_size != target.vocab_size or _vocab(self.draft) != _vocab(target):
            raise ValueError(
                f"drafter draft:{path}: its vocabulary ({self.draft.vocab_size} tokens) does not "
                f"match the target's ({target.vocab_size} tokens)"
            )
        self.num_draft_tokens = num_draft_tokens or 3
        self.caches = None  # per draft layer; row i mirrors batch row i

    def reset(self) -> None:
        self.caches = None

    def add_rows(self, batch, rows, hidden) -> None:
        num_before = 0 if self.caches is None else self.caches[0].num_rows
        assert rows == list(range(num_before, num_before + len(rows))), "rows join at the end"
        new = [self._prefill(batch.requests[i].all_token_ids[: batch.lengths[i] - 1]) for i in rows]
        parts = new if self.caches is None else [self.caches, *new]
        self.caches = concat_layer_caches(parts)

    def keep_rows(self, rows) -> None:
        if self.caches is not None:
            for cache in self.caches:
                cache.select_rows(rows)

    def propose(self, batch, num_tokens: int) -> mx.array:
        return self.propose_with_probs(batch, num_tokens, with_probs=False)[0]

    def propose_with_probs(self, batch, num_tokens: int, with_probs: bool = True):
        """Drafts (B, k) and, with_probs, the distributions (B, k, V) they were drawn from."""
        # Roll each row back to num_back tokens behind the target, then feed those tokens and
        # the pending one. num_back is 1 unless the row skipped drafting (k = 0 rounds) and its
        # draft KV lags the target's; rows feeding fewer tokens are padded on the right, read at
        # their pending token's slot and trimmed back, so the junk after it is never attended.
        lengths = batch.lengths
        num_back = [max(1, n - have) for n, have in zip(lengths, self.caches[0].lengths)]
        width = max(num_back) + 1
        self._trim_to([n - b for n, b in zip(lengths, num_back)])
        history = [[r.token_at(n - b + j) for j in range(b)] + [0] * (width - b)
                   for r, n, b in zip(batch.requests, lengths, num_back)]
        slot = mx.array(num_back, dtype=mx.int32)  # where each row's pending token goes
        tokens = mx.where(mx.arange(width)[None, :] == slot[:, None], batch.pending[:, None],
                          mx.array(history, dtype=mx.int32))  # (B, width)
        positions = batch.positions(num_tokens, first_offset=1)
        drafts, probs = [], []
        for j in range(num_tokens):
            hidden = self.draft.body(tokens, self.caches)  # (B, T, D)
            if j == 0:
                hidden = hidden[mx.arange(batch.num_rows), slot][:, None, :]  # (B, 1, D)
                for cache in self.caches:
                    cache.trim_rows([width - 1 - b for b in num_back])
            logits = self.draft.head(hidden[:, -1:, :])  # (B, 1, V)
            tokens = sample(logits, batch.draft_sampling, positions[:, j : j + 1])
            drafts.append(tokens)
            if with_probs:
                probs.append(probabilities(logits, batch.draft_sampling))
        return mx.concatenate(drafts, axis=1), (mx.concatenate(probs, axis=1) if with_probs else None)

    def on_verified(self, batch, num_accepted, hidden) -> None:
        pass

    def _trim_to(self, lengths: list[int]) -> None:
        for cache in self.caches:
            cache.trim_rows([have - want for have, want in zip(cache.lengths, lengths)])

    def _prefill(self, tokens: list[int]):
        caches = make_ragged_cache(self.draft.num_layers, stored_dtype=self.draft.kv_dtype)
        for start in range(0, len(tokens), _PREFILL_CHUNK_TOKENS):
            chunk = mx.array(tokens[start : start + _PREFILL_CHUNK_TOKENS], dtype=mx.int32)[None]
            self.draft.body(chunk, caches)
            mx.eval([c.keys for c in caches])
        return caches


def _vocab(model) -> dict:
    return model.tokenizer.get_vocab() if hasattr(model.tokenizer, "get_vocab") else {}
