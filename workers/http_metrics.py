"""Prometheus metrics of the HTTP gateway: its own request counts and latencies, and the
engine counters of every worker as the front-end's STATS reply gives them at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LOOPS = ("scalar", "batch", "bare", "gated", "plain", "settle", "capture")
# engine counter -> (metric name, help); each becomes a per-worker counter
_ENGINE_COUNTERS = {
    "num_requests": ("gmlx_engine_requests", "requests the worker's engine admitted"),
    "num_finished": ("gmlx_engine_finished", "requests the worker's engine finished"),
    "num_preempts": ("gmlx_engine_preempts", "lone speculating streams preempted by arrivals"),
    "num_resumes": ("gmlx_engine_resumes", "gated batches re-armed for speculation"),
    "num_gates": ("gmlx_engine_gates", "batches gated to plain decoding over the width cap"),
    "num_kv_evictions": ("gmlx_engine_kv_evictions", "decode rows evicted for the KV budget and prefilled again"),
    "num_drafted": ("gmlx_engine_drafted_tokens", "draft tokens proposed"),
    "num_accepted": ("gmlx_engine_accepted_tokens", "draft tokens accepted"),
}
_FRONTEND_COUNTERS = {
    "num_worker_restarts": ("gmlx_worker_restarts", "workers the front-end started again after they died"),
    "num_carried_over": ("gmlx_carried_over_requests", "requests moved on to the next worker when theirs died"),
}
_TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_ITL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class EngineStatsCollector:
    """Yields the last STATS reply as per-worker metric families (refreshed before each scrape)."""

    def __init__(self):
        self.stats: dict | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        workers = stats.get("workers") or []
        yield _gauge("gmlx_workers", "workers ready behind the front-end", [((), stats.get("num_workers", len(workers)))])
        yield _gauge("gmlx_frontend_queue_depth", "requests accepted and not yet decoding (front-end and engines)",
                     [((), stats.get("num_queued", 0))])
        for key, (name, help_text) in _FRONTEND_COUNTERS.items():
            family = CounterMetricFamily(name, help_text)
            family.add_metric([], stats.get(key, 0) or 0)
            yield family
        by_worker = [(str(w.get("worker_id")), w) for w in workers]
        yield _gauge("gmlx_engine_queue_depth", "requests queued in the worker's engine",
                     [((wid,), w.get("num_queued", 0)) for wid, w in by_worker], ["worker"])
        yield _gauge("gmlx_engine_active_rows", "rows decoding in the worker's batch",
                     [((wid,), w.get("num_active", 0)) for wid, w in by_worker], ["worker"])
        rounds = CounterMetricFamily("gmlx_engine_rounds", "decode rounds by loop", labels=["worker", "loop"])
        for wid, w in by_worker:
            for loop in _LOOPS:
                rounds.add_metric([wid, loop], w.get(f"num_{loop}_rounds", 0) or 0)
        yield rounds
        for key, (name, help_text) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["worker"])
            for wid, w in by_worker:
                family.add_metric([wid], w.get(key, 0) or 0)
            yield family
        acceptance = [((wid,), w["num_accepted"] / w["num_drafted"]) for wid, w in by_worker if w.get("num_drafted")]
        yield _gauge("gmlx_engine_acceptance_ratio", "accepted / drafted tokens since the worker started",
                     acceptance, ["worker"])


def _gauge(name: str, help_text: str, samples, labels=()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=list(labels))
    for label_values, value in samples:
        family.add_metric(list(label_values), value)
    return family


class GatewayMetrics:
    """One registry per gateway (not prometheus_client's global one), so tests can hold several."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gmlx_http_requests", "finished generate requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("gmlx_http_rejected_requests", "generate requests answered with an error status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("gmlx_http_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("gmlx_http_generation_tokens", "tokens sent to clients", registry=r)
        self.ttft_s = Histogram("gmlx_http_time_to_first_token_seconds", "request arrival to its first token",
                                buckets=_TTFT_BUCKETS_S, registry=r)
        self.inter_token_s = Histogram("gmlx_http_inter_token_seconds",
                                       "gap between a request's chunks divided over the chunk's tokens",
                                       buckets=_ITL_BUCKETS_S, registry=r)
        self.in_flight = Gauge("gmlx_http_requests_in_flight", "generate requests being answered", registry=r)
        self.engine = EngineStatsCollector()
        r.register(self.engine)

    def on_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """A chunk of `num_tokens` reached the gateway `gap_s` after the request's previous one."""
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens:
            per_token_s = gap_s / num_tokens
            for _ in range(num_tokens):
                self.inter_token_s.observe(per_token_s)

    def render(self, stats: dict | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
