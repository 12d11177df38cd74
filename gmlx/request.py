"""Engine-side request state: sampling parameters, status, and the per-step output message."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's cap on logit_bias tokens; it also bounds the bus slot's header
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty in (0, 10]: 1 is off, above 1 discourages repeats
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids a request may name (vLLM's extra); it also bounds the bus header


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(top token); 0 = off
    seed: int | None = None  # None = the engine draws one
    stop: tuple[str, ...] = ()  # stop strings, matched on text outside the engine core
    speculate: bool = True  # False pins the row to plain decoding (k = 0): it never drafts
    logprobs: int | None = None  # N: each token's logprob and its position's N likeliest (gmlx/logprobs.py)
    prompt_logprobs: int | None = None  # N: the same for the prompt's tokens (1.., on the first output)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time it was generated
    # OpenAI's: (token id, value added to its logit before sampling) pairs; a dict is taken and
    # stored as its pairs, so the parameters stay hashable (a dict's order changes no bit).
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # vLLM's and transformers' (llama.cpp's repeat_penalty over the whole context): a logit of a
    # token in the prompt or generated before is divided by it where positive, else multiplied.
    repetition_penalty: float = 1.0
    # vLLM's extras, which serving benchmarks send to fix output lengths:
    ignore_eos: bool = False  # the model's EOS tokens are tokens like any other: they end nothing
    min_tokens: int = 0  # the tokens that would end it (EOS, stop_token_ids) are not sampled before this many
    stop_token_ids: tuple[int, ...] = ()  # these end it as EOS does (not delivered); a list is taken

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()) or None)
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for text in self.stop:
            check_text("stop", text)
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be true or false, got {self.speculate!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_TOP_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, "
                             f"got {self.stop_token_ids!r:.200}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold token ids (integers >= 0), got {token_id!r}")

    @property
    def is_penalized(self) -> bool:
        """Whether it penalizes repeats (sampling.penalize)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_logit_bias(logit_bias) -> None:
    """Distinct token ids (their upper bound is the model's to check) with numbers in [-100, 100]."""
    if not isinstance(logit_bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in logit_bias):
        raise ValueError(f"logit_bias must map token ids to numbers, got {logit_bias!r:.200}")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(logit_bias)}")
    if len({token_id for token_id, _ in logit_bias}) < len(logit_bias):
        raise ValueError("logit_bias must name each token once")
    for token_id, value in logit_bias:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias must map token ids (integers >= 0), got the key {token_id!r}")
        _check_number("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must hold values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {value} for token {token_id}")


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def check_text(name: str, text: str) -> None:
    """ValueError naming the field where text holds a lone surrogate: what a shell's non-UTF-8
    bytes become in argv, and what no tokenizer or wire message takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid UTF-8 text, got a lone surrogate at character {e.start}") from None


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class RequestStatus(enum.IntEnum):
    # Ordered so that "finished" is one comparison.
    WAITING = 0  # in the injection queue, not yet prefilled
    PREFILLING = 1
    DECODING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
}


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's new tokens from one engine step; stats ride on the last one."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: dict | None = None
    logprobs: tuple | None = None  # a gmlx.logprobs.TokenLogprob per new token, where the request asked
    prompt_logprobs: tuple | None = None  # on its first output, where it asked: prompt positions 1..


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # of num_prefill_tokens, those already in the KV cache
    num_cached_prompt: int = 0  # prompt tokens reused from the prompt cache
    is_preempted: bool = False  # preempted requests are not offered back to the prompt cache
    arrival_seq: int = 0  # the engine's count of requests when it was added: evictions take the latest
    max_new_tokens: int = 0  # what it may generate: max_tokens, or less where the KV budget's row ends first
    num_kv_evictions: int = 0  # times its row left the batch for the KV budget and was prefilled again
    arrival_time_s: float = field(default_factory=time.perf_counter)
    first_token_time_s: float | None = None
    finish_time_s: float | None = None
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [j] = drafts accepted at depth j
    num_rounds_by_loop: dict = field(default_factory=dict)  # loop name (batch.Loop values) -> rounds
    # A drafter's own per-request state (the n-gram drafter's index of the history): it lives
    # and dies with the request, whatever batches and transitions the request passes through.
    drafter_memo: object = field(default=None, compare=False, repr=False)
    # Where it asks for logprobs: those of each position sampled and not yet delivered, by
    # absolute position (gmlx/logprobs.py).
    logprobs_by_position: dict = field(default_factory=dict, compare=False, repr=False)
    # The tokens that end it, not delivered: the model's EOS unless it ignores them, and its
    # stop_token_ids (the engine sets them as it takes the request).
    end_token_ids: frozenset = frozenset()
    # Its prompt's distinct ids, kept once computed (a repetition penalty reads them every round).
    distinct_prompt_ids: object = field(default=None, compare=False, repr=False)

    @property
    def min_tokens_floor(self) -> tuple[tuple[int, ...], int] | None:
        """(the tokens that would end it, the absolute position from which they may be sampled)
        where it asks for min_tokens: generated token g sits at position num_prompt_tokens + g."""
        if self.params.min_tokens == 0 or not self.end_token_ids:
            return None
        return tuple(sorted(self.end_token_ids)), self.num_prompt_tokens + self.params.min_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """What a prefill of this request runs: its prompt, and after an eviction every token it
        generated before it (their KV is rebuilt; the next token is sampled from the last)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_scoring_prompt(self) -> bool:
        """It asks for its prompt's logprobs and has no token yet: its prefill runs every prompt
        position (no prompt-cache prefix) and its first output carries them; prefilled again
        after an eviction, it has them already."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        return self.params.max_tokens - self.num_generated

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """all_token_ids[position] without building the list (the draft model asks every round)."""
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def count_verify(self, num_drafted: int, num_accepted: int) -> None:
        """One verify of this row's drafts: num_accepted of num_drafted kept, the first ones."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        by_position = self.accepted_by_position
        by_position.extend([0] * (num_drafted - len(by_position)))
        for depth in range(num_accepted):
            by_position[depth] += 1

    def make_stats(self) -> dict:
        end_s = self.finish_time_s or time.perf_counter()
        ttft_s = None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s
        decode_s = None if self.first_token_time_s is None else end_s - self.first_token_time_s
        decode_tok_per_s = (self.num_generated - 1) / decode_s if decode_s and self.num_generated > 1 else 0.0
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated,
            "cached_prompt_tokens": self.num_cached_prompt,
            "ttft_s": ttft_s,
            "decode_tok_per_s": decode_tok_per_s,
            "num_rounds": self.num_rounds,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "accepted_by_position": list(self.accepted_by_position),
            "tokens_per_round": self.num_generated / self.num_rounds if self.num_rounds else None,
            "rounds_by_loop": dict(self.num_rounds_by_loop),
            "is_preempted": self.is_preempted,
            "num_kv_evictions": self.num_kv_evictions,
            "seed": self.seed,
            "speculate": self.params.speculate,  # echoed like the seed: shows what the engine was asked
        }
