"""The decode batch: rows, their ragged target KV, and each row's pending token.

Every row has one pending token: the next input of the target, never in the KV. It is
either delivered (a bonus token the client has) or not yet delivered (a plain round's
lookahead, sampled by a forward dispatched ahead). At a settled round boundary every
pending token is delivered, so the KV holds every delivered token except the bonus.
"""

from __future__ import annotations

import mlx.core as mx

from gmlx.cache.ragged import RaggedKVCache, concat_layer_caches
from gmlx.request import Request, SamplingParams
from gmlx.sampling import SamplingRows

_GREEDY = SamplingParams()


class DecodeBatch:
    def __init__(self, requests: list[Request], caches: list[RaggedKVCache], pending: mx.array,
                 is_draft_coupled: bool = True):
        assert caches[0].num_rows == len(requests) == pending.shape[0]
        self.requests = requests
        self.caches = caches  # one per target layer
        self.pending = pending  # (B,) int32
        self.is_delivered = [True] * len(requests)
        self.is_scalar = False  # the single-request loop: no injection boundary
        self.is_armed = False  # the drafter holds valid state for every row
        self.was_gated = False  # gated at least once since the batch formed (resume latch)
        self.is_draft_coupled = is_draft_coupled  # batch-loop drafts sample with the row's own noise
        self._refresh_sampling()

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @property
    def lengths(self) -> list[int]:
        """Tokens in each row's target KV."""
        return self.caches[0].lengths

    @property
    def is_settled(self) -> bool:
        return all(self.is_delivered)

    def positions(self, num_tokens: int, first_offset: int = 0) -> mx.array:
        """Absolute positions (B, T) starting at each row's KV length + first_offset."""
        lengths = mx.array(self.lengths, dtype=mx.int32)
        return lengths[:, None] + first_offset + mx.arange(num_tokens, dtype=mx.int32)[None, :]

    def keep_rows(self, rows: list[int]) -> None:
        if rows == list(range(self.num_rows)):
            return
        for cache in self.caches:
            cache.select_rows(rows)
        self.requests = [self.requests[i] for i in rows]
        self.is_delivered = [self.is_delivered[i] for i in rows]
        self.pending = self.pending[mx.array(rows, dtype=mx.int32)] if rows else self.pending[:0]
        self._refresh_sampling()

    def append_rows(self, requests: list[Request], caches: list[RaggedKVCache], pending: mx.array) -> None:
        """Add rows whose pending token is delivered (freshly prefilled requests)."""
        self.caches = concat_layer_caches([self.caches, caches])
        self.requests = self.requests + requests
        self.is_delivered = self.is_delivered + [True] * len(requests)
        self.pending = mx.concatenate([self.pending, pending])
        self._refresh_sampling()

    @property
    def draft_sampling(self) -> SamplingRows:
        """How drafters sample: coupled to each row's noise, or greedy (the spec's batch loop)."""
        return self.sampling if self.is_scalar or self.is_draft_coupled else self._greedy_sampling

    def _refresh_sampling(self) -> None:
        seeds = [r.seed for r in self.requests]
        self.sampling = SamplingRows.make([r.params for r in self.requests], seeds)
        self._greedy_sampling = SamplingRows.make([_GREEDY] * len(seeds), seeds)
