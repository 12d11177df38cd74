"""STATS: ask every ready worker for its engine counters, answer once all have replied."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

CONTRACT_STAT_KEYS = ("num_requests", "num_active", "num_queued", "num_spec_rounds", "num_gated_rounds",
                      "num_capture_rounds", "num_preempts", "num_resumes", "num_drafted", "num_accepted")
# per worker, not summed
_SETTINGS = ("width_cap", "drafter", "is_prefill_packed", "max_row_tokens", "kv_reserve_tokens")
# calibration: the start-up cost table and its served correction; draft_depth: the depth policy's
# estimates and its ledger of kept drafts against expected ones (engine.stats())
_PER_WORKER_KEYS = ("width_cap", "drafter", "num_requests", "num_active", "num_queued", "calibration",
                    "draft_depth")


@dataclass
class StatsQuery:
    client_id: bytes
    ref: str
    waiting: set[int]  # worker ids yet to answer
    deadline_s: float
    parts: dict[int, dict] = field(default_factory=dict)  # worker id -> its engine stats

    @property
    def is_complete(self) -> bool:
        return not self.waiting or time.monotonic() > self.deadline_s


class StatsQueries:
    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._open: dict[int, StatsQuery] = {}

    def open(self, client_id: bytes, ref: str, worker_ids: set[int]) -> int:
        query_id = next(self._ids)
        self._open[query_id] = StatsQuery(client_id, ref, set(worker_ids), time.monotonic() + self._timeout_s)
        return query_id

    def on_answer(self, query_id: int, worker_id: int, stats: dict) -> None:
        query = self._open.get(query_id)
        if query is not None and worker_id in query.waiting:
            query.waiting.discard(worker_id)
            query.parts[worker_id] = stats

    def on_worker_gone(self, worker_id: int) -> None:
        for query in self._open.values():
            query.waiting.discard(worker_id)

    def pop_complete(self) -> list[StatsQuery]:
        """Queries every worker answered, or that timed out (answered with what came)."""
        done = [query_id for query_id, query in self._open.items() if query.is_complete]
        return [self._open.pop(query_id) for query_id in done]


def merge_worker_stats(parts: dict[int, dict]) -> dict:
    """Counters summed over workers; settings from the lowest worker id; a per-worker list."""
    merged: dict = dict.fromkeys(CONTRACT_STAT_KEYS, 0)
    merged["width_cap"] = None
    for i, worker_id in enumerate(sorted(parts)):
        for key, value in parts[worker_id].items():
            if key in _SETTINGS:
                merged[key] = value if i == 0 else merged[key]
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "acceptance_rate":
                merged[key] = merged.get(key, 0) + value
    merged["acceptance_rate"] = merged["num_accepted"] / merged["num_drafted"] if merged["num_drafted"] else None
    merged["workers"] = [{"worker_id": worker_id, **_per_worker(parts[worker_id])} for worker_id in sorted(parts)]
    return merged


def _per_worker(stats: dict) -> dict:
    """The settings and every engine counter of one worker (the HTTP gateway's /metrics labels them)."""
    out = {k: stats.get(k) for k in _PER_WORKER_KEYS}
    out.update((k, v) for k, v in stats.items()
               if k.startswith("num_") and isinstance(v, int) and not isinstance(v, bool))
    return out
