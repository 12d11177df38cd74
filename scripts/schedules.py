"""Randomized schedules: arrivals, budgets, caps, cancels and switches, checked against solo plain decoding.

Shared by the test suite and scripts/fuzz_schedules.py (which runs thousands).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from gmlx.config import EngineConfig, env_overrides
from gmlx.engine import Engine
from gmlx.request import SamplingParams


@dataclass(frozen=True)
class Arrival:
    round_index: int
    token_ids: tuple[int, ...]
    params: SamplingParams
    cancel_after_rounds: int | None  # cancel this many rounds after arrival, None = never
    num_generated: int = 0  # a carried-over request: the last that many token_ids are its own tokens


@dataclass(frozen=True)
class Schedule:
    seed: int
    width_cap: int
    is_preempt_on: bool
    is_resume_on: bool
    resume_min_budget: int
    arrivals: tuple[Arrival, ...]


@dataclass
class ScheduleResult:
    counters: dict
    tokens: dict = field(default_factory=dict)  # arrival index -> emitted tokens
    logprobs: dict = field(default_factory=dict)  # arrival index -> a TokenLogprob per token, where it asked
    prompt_logprobs: dict = field(default_factory=dict)  # arrival index -> its prompt's, where it asked
    finish: dict = field(default_factory=dict)  # arrival index -> finish reason


def make_schedule(seed: int, vocab_size: int, prompt_pool: list[list[int]], max_requests: int = 6,
                  caps=(0, 1, 2, 4), temperatures=(0.0, 0.8), opt_out_rate: float = 0.0,
                  max_new_tokens: int = 40, logprobs_rate: float = 0.0, penalty_rate: float = 0.0,
                  bias_rate: float = 0.0, end_rate: float = 0.0, eos_token_id: int = 0) -> Schedule:
    """A random schedule; opt_out_rate is the share of requests with speculate=False and
    logprobs_rate of those asking for logprobs, penalty_rate of those penalizing repeats,
    bias_rate of those with a logit_bias, end_rate of those with stop_token_ids, min_tokens or
    ignore_eos (each drawn only when > 0, so the schedules of a seed without them stay what they
    were; eos_token_id is the model's, which some end_rate draws make likely);
    max_tokens are drawn in 1..max_new_tokens."""
    rng = random.Random(seed)
    arrivals, round_index = [], 0
    for _ in range(rng.randint(1, max_requests)):
        round_index += rng.choice((0, 0, 1, 2, 3, 5, 8, 13))
        if rng.random() < 0.5 and prompt_pool:
            base = rng.choice(prompt_pool)
            prompt = base[: rng.randint(1, len(base))]
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))]
        temperature = rng.choice(temperatures)
        params = SamplingParams(
            max_tokens=rng.randint(1, max_new_tokens), temperature=temperature,
            top_p=rng.choice((1.0, 0.9)) if temperature else 1.0,
            top_k=rng.choice((0, 0, 20)) if temperature else 0,
            seed=rng.randrange(2**31),
            speculate=not (opt_out_rate > 0 and rng.random() < opt_out_rate),
        )
        cancel = rng.randint(0, 10) if rng.random() < 0.1 else None
        if logprobs_rate > 0 and rng.random() < logprobs_rate:
            params = dataclasses.replace(params, logprobs=rng.choice((0, 1, 5, 20)),
                                         prompt_logprobs=rng.choice((None, 0, 3)))
        if penalty_rate > 0 and rng.random() < penalty_rate:
            params = dataclasses.replace(params, presence_penalty=rng.choice((0.0, 0.5, 2.0)),
                                         frequency_penalty=rng.choice((0.0, 0.3, -0.5, 2.0)),
                                         repetition_penalty=rng.choice((1.0, 1.0, 1.3, 0.8, 2.5)))
        if bias_rate > 0 and rng.random() < bias_rate:
            # The prompt's own tokens are the likely ones to come next: ban, damp, boost or (rarely,
            # as it ends all speculation) force them.
            ids = {rng.choice(prompt) if rng.random() < 0.7 else rng.randrange(vocab_size)
                   for _ in range(rng.randint(1, 4))}
            values = (-100.0, -100.0, -4.0, 2.5, 2.5, 6.0, 6.0, -4.0, 100.0)
            params = dataclasses.replace(params, logit_bias={t: rng.choice(values) for t in ids})
        if end_rate > 0 and rng.random() < end_rate:
            # Stop tokens the answer is likely to hold (the prompt's), held back for a while; or
            # EOS made likely by a bias, and ignored.
            min_tokens = rng.randint(0, params.max_tokens)
            if rng.random() < 0.7:
                params = dataclasses.replace(params, min_tokens=min_tokens,
                                             stop_token_ids=tuple({rng.choice(prompt) for _ in range(rng.randint(1, 3))}))
            else:
                params = dataclasses.replace(params, min_tokens=min_tokens, ignore_eos=rng.random() < 0.5,
                                             logit_bias={eos_token_id: rng.choice((3.0, 8.0, 100.0))})
        arrivals.append(Arrival(round_index, tuple(prompt), params, cancel))
    return Schedule(seed, rng.choice(caps), rng.random() < 0.8, rng.random() < 0.8,
                    rng.choice((0, 2, 4, 32)), tuple(arrivals))


def switches(schedule: Schedule):
    values = {
        "GMLX_MTP_WIDTH_CAP": str(schedule.width_cap),
        "GMLX_MTP_PREEMPT": "1" if schedule.is_preempt_on else "0",
        "GMLX_MTP_RESUME": "1" if schedule.is_resume_on else "0",
        "GMLX_RESUME_MIN_BUDGET": str(schedule.resume_min_budget),
    }
    return env_overrides(values)


def run_schedule(engine: Engine, schedule: Schedule, max_rounds: int = 2000) -> ScheduleResult:
    result = ScheduleResult(counters={})
    before = dict(engine.counters)
    ids: dict[str, int] = {}
    cancel_at: dict[int, list[str]] = {}
    pending = list(enumerate(schedule.arrivals))
    with switches(schedule):
        for round_index in range(max_rounds):
            while pending and pending[0][1].round_index <= round_index:
                index, arrival = pending.pop(0)
                request_id = engine.add_request(list(arrival.token_ids), arrival.params,
                                                num_generated=arrival.num_generated)
                ids[request_id] = index
                result.tokens[index] = []
                result.logprobs[index] = []
                if arrival.cancel_after_rounds is not None:
                    cancel_at.setdefault(round_index + arrival.cancel_after_rounds, []).append(request_id)
            for request_id in cancel_at.pop(round_index, []):
                engine.abort_request(request_id)
            for output in engine.step():
                index = ids[output.request_id]
                result.tokens[index].extend(output.new_token_ids)
                result.logprobs[index].extend(output.logprobs or ())
                if output.prompt_logprobs is not None:
                    assert index not in result.prompt_logprobs, f"request {index}: prompt logprobs twice"
                    result.prompt_logprobs[index] = list(output.prompt_logprobs)
                if output.finish_reason is not None:
                    assert index not in result.finish, f"request {index} finished twice"
                    result.finish[index] = output.finish_reason
            if not pending and not engine.has_unfinished():
                break
        else:
            raise AssertionError(f"schedule {schedule.seed} did not finish in {max_rounds} rounds")
    result.counters = {k: engine.counters[k] - before.get(k, 0) for k in engine.counters}
    return result


class SoloReference:
    """Solo plain decoding of one request, memoized: the ground truth every stream must equal."""

    def __init__(self, target):
        self.engine = Engine(target, None, EngineConfig(prompt_cache_bytes=0))
        self._memo: dict = {}

    def tokens(self, token_ids, params: SamplingParams) -> tuple[list[int], str]:
        return self._run(token_ids, params)[:2]

    def logprobs(self, token_ids, params: SamplingParams) -> list:
        """Each token's gmlx.logprobs.TokenLogprob, for params that ask for logprobs."""
        return self._run(token_ids, params)[2]

    def prompt_logprobs(self, token_ids, params: SamplingParams) -> list:
        """The prompt's (positions 1..), for params that ask for prompt_logprobs."""
        return self._run(token_ids, params)[3]

    def _run(self, token_ids, params: SamplingParams) -> tuple:
        key = (tuple(token_ids), params)
        if key not in self._memo:
            self._memo[key] = _drive_alone(self.engine, token_ids, params)
        return self._memo[key]


def run_alone(engine: Engine, token_ids, params: SamplingParams) -> tuple[list[int], str, dict]:
    """One request through an otherwise idle engine to its end: (tokens, finish reason, final stats)."""
    tokens, reason, _, _, stats = _drive_alone(engine, token_ids, params)
    return tokens, reason, stats


def _drive_alone(engine: Engine, token_ids, params: SamplingParams) -> tuple:
    """(tokens, finish reason, logprobs, prompt logprobs, final stats)."""
    request_id = engine.add_request(list(token_ids), params)
    out, reason, stats, logprobs, prompt_logprobs = [], None, None, [], None
    while reason is None:
        for output in engine.step():
            assert output.request_id == request_id
            out.extend(output.new_token_ids)
            logprobs.extend(output.logprobs or ())
            prompt_logprobs = output.prompt_logprobs if output.prompt_logprobs is not None else prompt_logprobs
            reason, stats = output.finish_reason, output.stats
    return out, reason, logprobs, None if prompt_logprobs is None else list(prompt_logprobs), stats


def check_schedule(engine: Engine, reference: SoloReference, schedule: Schedule) -> ScheduleResult:
    """Run `schedule` and assert every stream equals its solo plain decoding."""
    result = run_schedule(engine, schedule)
    for index, arrival in enumerate(schedule.arrivals):
        expected, expected_reason = reference.tokens(arrival.token_ids, arrival.params)
        got = result.tokens[index]
        reason = result.finish[index]
        where = f"schedule {schedule.seed}, request {index} ({reason})"
        if reason == "cancelled":
            assert got == expected[: len(got)], f"{where}: {got} is not a prefix of {expected}"
        else:
            assert (got, reason) == (expected, expected_reason), f"{where}: {got} != {expected}"
        if arrival.params.logprobs is not None:  # the same bits as plain decoding's, token by token
            expected_logprobs = reference.logprobs(arrival.token_ids, arrival.params)[: len(got)]
            assert result.logprobs[index] == expected_logprobs, f"{where}: logprobs differ from plain decoding's"
        else:
            assert not result.logprobs[index], f"{where}: logprobs nobody asked for"
        if arrival.params.prompt_logprobs is not None and reason != "cancelled":
            expected_prompt = reference.prompt_logprobs(arrival.token_ids, arrival.params)
            assert result.prompt_logprobs.get(index) == expected_prompt, f"{where}: prompt logprobs differ"
        elif arrival.params.prompt_logprobs is None:
            assert index not in result.prompt_logprobs, f"{where}: prompt logprobs nobody asked for"
    return result
