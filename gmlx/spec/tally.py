"""The engine's counters and transition log: what stats() reports, and what the speculative
rounds since the batch last armed drafted and kept (a gate's event reports it)."""

from __future__ import annotations

import collections
import logging
import time

from gmlx.spec.batch import Loop

logger = logging.getLogger(__name__)

STAT_KEYS = (
    "num_requests", "num_finished", "num_rounds", "num_spec_rounds", "num_scalar_rounds",
    "num_batch_rounds", "num_bare_rounds", "num_gated_rounds", "num_plain_rounds", "num_settle_rounds",
    "num_capture_rounds", "num_preempts", "num_resumes", "num_gates", "num_depth_gates", "num_drafted",
    "num_accepted", "num_packed_chunks", "num_kv_evictions",
)
NUM_EVENTS_KEPT = 4096
NUM_EVENTS_REPORTED = 64  # stats() carries the latest few: a stats reply stays small


class Tally:
    def __init__(self):
        self.counters = dict.fromkeys(STAT_KEYS, 0)
        self.events: collections.deque = collections.deque(maxlen=NUM_EVENTS_KEPT)
        # (spec rounds, drafted, accepted) when the batch last armed (a capture, or forming armed)
        self._armed_since: tuple[int, int, int] | None = None

    def count_round(self, loop: Loop) -> None:
        self.counters["num_rounds"] += 1
        self.counters[f"num_{loop.value}_rounds"] += 1
        if loop.is_speculative:
            self.counters["num_spec_rounds"] += 1

    def count_verify(self, num_drafted: int, num_accepted: int) -> None:
        self.counters["num_drafted"] += num_drafted
        self.counters["num_accepted"] += num_accepted

    def mark_armed(self) -> None:
        c = self.counters
        self._armed_since = (c["num_spec_rounds"], c["num_drafted"], c["num_accepted"])

    def take_armed_stretch(self) -> dict:
        """What the speculative rounds since the batch last armed drafted and kept; {} when it
        has not armed since the last call."""
        if self._armed_since is None:
            return {}
        c = self.counters
        since_rounds, since_drafted, since_accepted = self._armed_since
        self._armed_since = None
        return {"spec_rounds": c["num_spec_rounds"] - since_rounds, "drafted": c["num_drafted"] - since_drafted,
                "accepted": c["num_accepted"] - since_accepted}

    def event(self, kind: str, width: int, **fields) -> None:
        event = {"kind": kind, "round": self.counters["num_rounds"], "time_s": time.perf_counter(),
                 "width": width, **fields}
        self.events.append(event)
        logger.log(logging.DEBUG if kind == "admit" else logging.INFO, "transition %s", event)

    def snapshot(self) -> dict:
        """The counters, the acceptance rate over every verify, and the latest events."""
        c = self.counters
        return {**c, "acceptance_rate": c["num_accepted"] / c["num_drafted"] if c["num_drafted"] else None,
                "events": list(self.events)[-NUM_EVENTS_REPORTED:]}
