"""The KV budget: how many requests may hold decode rows without the rows' caches outgrowing
the memory set aside for them.

A batch's KV buffers are one array per layer, every row as wide as the widest (ragged.py), so
rows in flight hold at most num_rows x widest x bytes a token, where widest is the buffers' own
width or the widest row's reservation, whichever is more. A row reserves what it holds (prompt
and tokens so far) and room to grow: up to reserve_tokens more of what it may generate, and a
verify's drafts past its end, rounded up to the buffers' growth step. Requests are admitted in
arrival order while that stays within the budget; rows that grow past it are evicted, latest
arrival first, and resume by re-prefill (engine.py). With reserve_tokens 0 a row reserves all it
may generate, so none is ever evicted. What one row may hold alone bounds a request as the
model's context does: a longer prompt is refused, and generation stops there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import psutil

from gmlx import config
from gmlx.cache.ragged import STEP_TOKENS

if TYPE_CHECKING:
    from gmlx.request import Request

# The default budget's share of the memory free at start: the rest covers a join's or a growth's
# second copy of the buffers while it is made, the prompt cache, mlx's scratch and the OS.
DEFAULT_AVAILABLE_SHARE = 0.4


class KVBudget:
    def __init__(self, bytes_per_token: int, budget_bytes: int, margin_tokens: int, reserve_tokens: int = 0):
        assert bytes_per_token > 0 and budget_bytes > 0 and margin_tokens >= 0 and reserve_tokens >= 0
        self.bytes_per_token = bytes_per_token  # one row's keys and values for a token, every layer
        self.budget_bytes = budget_bytes
        self.margin_tokens = margin_tokens  # a verify's positions written past a row's end
        self.reserve_tokens = reserve_tokens  # growth reserved ahead of a row's length; 0: all it may generate

    def row_tokens(self, num_prompt_tokens: int, num_new_tokens: int) -> int:
        """The width a row may grow to: its prompt and new tokens, a verify's margin, rounded up
        to the buffers' growth step."""
        tokens = num_prompt_tokens + num_new_tokens + self.margin_tokens
        return -(-tokens // STEP_TOKENS) * STEP_TOKENS

    def reserved_tokens(self, num_held_tokens: int, num_left_tokens: int) -> int:
        """The width a row is charged: the tokens it holds (or will once prefilled) and the growth
        reserved for the num_left_tokens it may still generate. What one round writes (the row's
        pending token, a verify's drafts) stays within it, so a check before a round covers it."""
        reserve = self.reserve_tokens
        return self.row_tokens(num_held_tokens, num_left_tokens if reserve == 0 else min(num_left_tokens, reserve))

    def fits(self, num_rows: int, widest_tokens: int) -> bool:
        return self.rows_bytes(num_rows, widest_tokens) <= self.budget_bytes

    def rows_bytes(self, num_rows: int, widest_tokens: int) -> int:
        return num_rows * widest_tokens * self.bytes_per_token

    def max_row_tokens(self) -> int:
        """The most prompt and new tokens one row may hold with no other row (may be <= 0)."""
        num_steps = self.budget_bytes // (self.bytes_per_token * STEP_TOKENS)
        return num_steps * STEP_TOKENS - self.margin_tokens

    def num_admissible(self, num_rows: int, widest_tokens: int, waiting_tokens: Iterable[int],
                       max_new_rows: int) -> int:
        """How many of the waiters (their row_tokens, in arrival order) may join num_rows rows in
        flight, as wide as widest_tokens, now; at most max_new_rows. The first that would overflow
        the budget and every one after it wait."""
        widest = widest_tokens
        num_admitted = 0
        for tokens in waiting_tokens:
            if num_admitted >= max_new_rows:
                break
            widest = max(widest, tokens)
            if not self.fits(num_rows + num_admitted + 1, widest):
                break
            num_admitted += 1
        return num_admitted

    def reserved_for(self, request: Request) -> int:
        """The width the request's row is charged: what it holds (or will once prefilled) and
        the growth reserved for what it may still generate."""
        return self.reserved_tokens(request.num_prefill_tokens, request.max_new_tokens - request.num_generated)

    def num_admissible_requests(self, in_flight: Sequence[Request], buffer_tokens: int,
                                waiting: Iterable[Request], max_new_rows: int) -> int:
        """How many of the first max_new_rows waiters may take rows beside the rows in flight,
        whose buffers are buffer_tokens wide."""
        widest = max([self.reserved_for(r) for r in in_flight] + [buffer_tokens])
        return self.num_admissible(len(in_flight), widest, (self.reserved_for(r) for r in waiting), max_new_rows)

    def next_victim(self, holders: Sequence[Request], buffer_tokens: int) -> Request | None:
        """The request that must give its KV up now: the latest arrival, while the holders'
        reservations do not fit beside buffers buffer_tokens wide (the buffers narrow as rows
        leave, so ask again after each). None once they fit; the earliest arrival always keeps its row."""
        if len(holders) <= 1 or self.fits(len(holders), max([self.reserved_for(r) for r in holders] + [buffer_tokens])):
            return None
        return max(holders, key=lambda r: r.arrival_seq)


def default_budget_bytes(num_sharers: int = 1) -> int:
    """GMLX_KV_CACHE_MB, else 1/num_sharers of DEFAULT_AVAILABLE_SHARE of the memory free now
    (a GPU's own where mlx reports it, else the host's): num_sharers engines start together."""
    configured_mb = config.kv_cache_budget_mb()
    if configured_mb is not None:
        return configured_mb << 20
    device_bytes = mx.device_info().get("memory_size") if mx.default_device() == mx.gpu else None
    return int(DEFAULT_AVAILABLE_SHARE * (device_bytes or psutil.virtual_memory().available)) // num_sharers
