"""The in-process engine as a benchmark target.

The engine is single-threaded, so one loop drives both sides: between steps it admits the
requests whose arrival time has come (or, closed loop, refills the free slots), then runs
one step and time-stamps the tokens it returned.
"""

from __future__ import annotations

import contextlib
import logging
import time

from workers.bench.metrics import StreamRecord, counter_delta
from workers.bench.targets import TargetSpec
from workers.bench.workload import RequestSpec, Workload
from gmlx.config import env_overrides

logger = logging.getLogger(__name__)

_PROCESS_WIDE_ENV = ("GMLX_CPU_AMX",)  # set around each run instead (_kernel_settings)


class EngineTarget:
    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.engine = None

    def start(self) -> None:
        from gmlx.config import EngineConfig
        from gmlx.platform.blas import ensure_fast_blas

        ensure_fast_blas()  # before the engine imports mlx
        from gmlx.engine import Engine

        drafter = {"drafter": self.spec.drafter} if self.spec.drafter else {}  # none given: the engine's default
        # The load-time knobs (row invariance) too, but not the kernels' process-wide switches: the
        # extension reads them once, at its first load, so one target's would become every target's.
        load_env = {k: v for k, v in self.spec.gmlx_env().items() if k not in _PROCESS_WIDE_ENV}
        with env_overrides(load_env):
            self.engine = Engine.load(EngineConfig(model_path=self.spec.model, **drafter,
                                                   num_draft_tokens=self.spec.num_draft_tokens))

    def stop(self) -> None:
        self.engine = None

    def describe(self) -> dict:
        from workers.bench.model_files import gmlx_format

        return {**self.spec.describe(), "model_path": self.engine.model_path if self.engine else None,
                "format": gmlx_format(self.spec.model)}

    def run(self, workload: Workload, progress, timeout_s: float) -> dict:
        """Run the workload; returns records, counter delta and transition events."""
        from gmlx.request import SamplingParams

        engine = self.engine
        specs = sorted(workload.requests, key=lambda s: (s.arrival_s or 0.0, s.index))
        prompts = {s.index: engine.tokenizer.encode(s.prompt) for s in specs}
        records: list[StreamRecord] = []
        by_request_id: dict[str, StreamRecord] = {}
        before = engine.stats()
        start_s = time.perf_counter()

        def now_s() -> float:
            return time.perf_counter() - start_s

        def add(spec: RequestSpec, arrival_s: float) -> None:
            record = StreamRecord(spec.index, spec.group, spec.max_tokens, arrival_s,
                                  prompt_tokens=len(prompts[spec.index]))
            records.append(record)
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=workload.temperature,
                                    seed=spec.index, ignore_eos=workload.is_ignore_eos)
            try:
                by_request_id[engine.add_request(prompts[spec.index], params)] = record
            except ValueError as exc:
                record.finish(now_s(), "error", str(exc))
                progress.update(done=1)

        next_i = 0
        with env_overrides(self.spec.gmlx_env()), _kernel_settings(self.spec):
            while True:
                if now_s() > timeout_s:
                    self._abort(by_request_id, now_s())
                    break
                if workload.is_open_loop:
                    while next_i < len(specs) and specs[next_i].arrival_s <= now_s():
                        add(specs[next_i], specs[next_i].arrival_s)
                        next_i += 1
                else:
                    while next_i < len(specs) and len(by_request_id) < workload.concurrency:
                        add(specs[next_i], now_s())
                        next_i += 1
                if not engine.has_unfinished():
                    if next_i >= len(specs):
                        break
                    time.sleep(max(0.0, min(specs[next_i].arrival_s - now_s(), 0.05)))
                    continue
                outputs = engine.step()
                self._record(outputs, by_request_id, now_s(), progress)
        after = engine.stats()
        return {"records": records, "counters": counter_delta(before, after),
                "events": self._events(start_s), "server_stats": _strip_events(after)}

    @staticmethod
    def _record(outputs, by_request_id: dict, time_s: float, progress) -> None:
        num_tokens = num_done = 0
        for out in outputs:
            record = by_request_id.get(out.request_id)
            if record is None:
                continue
            record.add_chunk(time_s, len(out.new_token_ids))
            num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                record.finish(time_s, out.finish_reason)  # the engine fails no request in-process
                record.stats = out.stats
                del by_request_id[out.request_id]
                num_done += 1
        progress.update(done=num_done, in_flight=len(by_request_id), tokens=num_tokens)

    def _abort(self, by_request_id: dict, time_s: float) -> None:
        for request_id, record in list(by_request_id.items()):
            self.engine.abort_request(request_id)
            record.finish(time_s, "cancelled", "timeout")
        by_request_id.clear()
        while self.engine.has_unfinished():  # collect the aborted requests' final outputs
            self.engine.step()

    def _events(self, start_s: float) -> list[dict]:
        events = getattr(self.engine, "events", None)
        if events is None:
            events = self.engine.stats().get("events", [])
        return [{**e, "time_s": round(e["time_s"] - start_s, 6)} for e in events
                if e.get("kind") != "admit" and e.get("time_s", 0.0) >= start_s]


def _strip_events(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "events"}


@contextlib.contextmanager
def _kernel_settings(spec: TargetSpec):
    """The CPU kernels' process-wide switches this target sets, restored after its run (the extension
    reads GMLX_CPU_AMX once, at load; a target without the knob runs under the process's setting)."""
    from gmlx.platform import cpu_kernels

    ext = cpu_kernels.extension() if spec.amx is not None and cpu_kernels.is_built() else None
    if ext is None:
        yield
        return
    setting = ext.amx_setting()
    ext.set_amx(int(spec.amx))
    try:
        yield
    finally:
        ext.set_amx(setting)
