"""Per-stream timing records and the summary computed from them.

All times are seconds on the load generator's perf_counter, relative to the run's start.
Time to first token counts from the request's scheduled arrival (open loop) or its send
(closed loop), so a late start caused by a busy server is charged to the server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

TRANSITION_KEYS = ("num_preempts", "num_resumes", "num_capture_rounds", "num_gated_rounds", "num_gates",
                   "num_spec_rounds", "num_rounds", "num_drafted", "num_accepted")
EVENT_KINDS = ("preempt", "gate", "capture", "resume")


@dataclass(slots=True)
class StreamRecord:
    index: int
    group: str
    max_tokens: int
    arrival_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # one per token-carrying chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    stats: dict | None = None  # the final chunk's stats, where the target gives them
    transport_s: list[float] = field(default_factory=list)  # gmlx server: worker send -> client receive

    def add_chunk(self, time_s: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.chunk_times_s and time_s == self.chunk_times_s[-1]:  # two outputs of one engine step
            self.chunk_tokens[-1] += num_tokens
        else:
            self.chunk_times_s.append(time_s)
            self.chunk_tokens.append(num_tokens)

    def set_num_tokens(self, num_tokens: int, time_s: float) -> None:
        """Make the record hold exactly num_tokens: trim the last chunks, or add the rest at time_s
        (a server's final count, where its events carried an end token or held some back)."""
        excess = self.num_tokens - num_tokens
        while excess > 0 and self.chunk_tokens:
            taken = min(excess, self.chunk_tokens[-1])
            self.chunk_tokens[-1] -= taken
            excess -= taken
            if self.chunk_tokens[-1] == 0:
                self.chunk_tokens.pop()
                self.chunk_times_s.pop()
        if excess < 0:
            self.add_chunk(time_s, -excess)

    def finish(self, time_s: float, reason: str | None, error: str | None = None) -> None:
        self.finish_s, self.finish_reason, self.error = time_s, reason, error

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.arrival_s if self.chunk_times_s else None

    @property
    def decode_tok_per_s(self) -> float | None:
        """Tokens after the first over the time after the first."""
        if len(self.chunk_times_s) < 2:
            return None
        span_s = self.chunk_times_s[-1] - self.chunk_times_s[0]
        return (self.num_tokens - self.chunk_tokens[0]) / span_s if span_s > 0 else None

    def token_gaps_s(self) -> list[float]:
        """Inter-token latency: each chunk's gap from the previous one, split over its tokens."""
        gaps = []
        for prev, time_s, n in zip(self.chunk_times_s, self.chunk_times_s[1:], self.chunk_tokens[1:]):
            gaps += [(time_s - prev) / n] * n
        return gaps

    def to_json(self) -> dict:
        data = asdict(self)
        data["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        data["transport_s"] = [round(t, 6) for t in self.transport_s]
        return data


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict:
    return {
        "p50": percentile(values, 50), "p95": percentile(values, 95), "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None, "max": max(values) if values else None,
        "count": len(values),
    }


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """Engine counters gained during the run (stats() read before and after it)."""
    if not before or not after:
        return {}
    return {k: after[k] - before.get(k, 0) for k in after
            if k.startswith("num_") and isinstance(after[k], (int, float)) and k not in ("num_active", "num_queued")}


def summarize(records: list[StreamRecord], counters: dict | None = None) -> dict:
    done = [r for r in records if r.finish_s is not None and r.error is None]
    num_tokens = sum(r.num_tokens for r in records)
    starts = [r.arrival_s for r in records]
    ends = [r.finish_s for r in records if r.finish_s is not None]
    duration_s = max(ends) - min(starts) if ends else None
    summary = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": sum(r.error is not None for r in records),
        "num_output_tokens": num_tokens,
        "duration_s": duration_s,
        "aggregate_tok_per_s": num_tokens / duration_s if duration_s else None,
        "ttft_s": distribution([r.ttft_s for r in records if r.ttft_s is not None]),
        "itl_s": distribution([g for r in records for g in r.token_gaps_s()]),
        "stream_tok_per_s": distribution([r.decode_tok_per_s for r in records if r.decode_tok_per_s]),
        "e2e_s": distribution([r.finish_s - r.arrival_s for r in done]),
    }
    transport = [t for r in records for t in r.transport_s]
    if transport:  # the server's own delivery delay, apart from decoding
        summary["transport_s"] = distribution(transport)
    summary.update(acceptance(records, counters))
    summary["transitions"] = {k: counters[k] for k in TRANSITION_KEYS if counters and k in counters}
    summary["num_preempted_streams"] = sum(bool(r.stats and r.stats.get("is_preempted")) for r in records)
    groups = sorted({r.group for r in records})
    if len(groups) > 1:  # e.g. the scripted load's lone stream and its arrivals, apart
        summary["groups"] = {g: _group_summary([r for r in records if r.group == g]) for g in groups}
    return summary


def _group_summary(records: list[StreamRecord]) -> dict:
    return {"ttft_s": distribution([r.ttft_s for r in records if r.ttft_s is not None]),
            "stream_tok_per_s": distribution([r.decode_tok_per_s for r in records if r.decode_tok_per_s])}


def acceptance(records: list[StreamRecord], counters: dict | None) -> dict:
    """Drafts accepted over drafted: from the streams' final stats, else the engine counters."""
    drafted = sum((r.stats or {}).get("num_drafted") or 0 for r in records)
    accepted = sum((r.stats or {}).get("num_accepted") or 0 for r in records)
    if not drafted and counters:
        drafted, accepted = counters.get("num_drafted", 0), counters.get("num_accepted", 0)
    return {"num_drafted": drafted, "num_accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
