"""Between rounds: the injection drain (chunked prefill of waiters), the width cap, resume.

The injection queue holds requests not yet prefilled. A drain spends a token budget on
prefill chunks; a request whose prompt is fully in its KV gets its first token sampled
from the prefill and is handed back to join the batch. A request evicted for the KV budget
(engine.py) waits here again, at the head: its prefill runs its prompt and the tokens it
generated, and samples its next token.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from gmlx import config, logprobs
from gmlx.cache.ragged import RaggedKVCache, make_ragged_cache
from gmlx.models.loader import LoadedModel
from gmlx.request import Request, RequestStatus
from gmlx.sampling import SamplingRows, sample
from gmlx.spec.batch import repeat_counts

MIN_CHUNK_TOKENS = 1  # a time budget never shrinks a chunk below this: prefill must progress
FIRST_BUDGETED_TOKENS = 16  # the first chunk under a time budget, before any chunk was timed
# The least a packed chunk is taken to cost: a chunk riding a round's forward can cost less than
# the round's own jitter (a few tokens beside the decode rows in one stack node).
MIN_PACKED_CHUNK_S = 1e-4


@dataclass(frozen=True)
class Prefilled:
    request: Request
    caches: list[RaggedKVCache]  # the whole prompt, one row
    first_token: int  # delivered; the row's pending token
    hidden: mx.array  # (D,) the hidden state that produced first_token


class PackedChunk:
    """A prompt chunk that rides the next decode forward (models/packed.py) instead of its own.

    Planned by the queue, run inside the batch's dispatched forward, then committed; the
    chunk that ends its prompt carries the first token (lazy until the forward is read)."""

    def __init__(self, request: Request, caches: list[RaggedKVCache], start: int, num_tokens: int):
        self.request = request
        self.caches = caches
        self.start = start  # first prompt position of the chunk
        self.num_tokens = num_tokens
        self.first_token: mx.array | None = None  # (1, 1) once run, when is_last
        self.last_hidden: mx.array | None = None  # (1, 1, D) once run, when is_last

    @property
    def tokens(self) -> mx.array:
        ids = self.request.all_token_ids[self.start : self.start + self.num_tokens]
        return mx.array(ids, dtype=mx.int32)[None]  # (1, T)

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == self.request.num_prefill_tokens


class InjectionQueue:
    def __init__(self, target: LoadedModel, chunk_tokens: int, prompt_cache,
                 reserved_tokens: Callable[[Request], int]):
        self.target = target
        self.reserved_tokens = reserved_tokens  # the width the KV budget charges a request's row
        self.chunk_tokens = chunk_tokens
        self.prompt_cache = prompt_cache
        self.waiting: collections.deque[Request] = collections.deque()
        self._caches: dict[str, list[RaggedKVCache]] = {}  # request id -> partial prefill
        self._last_chunk: tuple[int, float] | None = None  # (tokens, seconds) of the last timed chunk

    def token_budget(self, budget_s: float | None) -> int:
        """Prompt tokens one drain may prefill: chunk_tokens, or under a time budget the last
        timed chunk scaled by budget / its time (the cost per token has a fixed part and grows
        with the prefix, so a ratio tracks it better than a rate). At most x1.25 up a step (a
        chunk timed in a lull must not double the next) and /2 down."""
        if budget_s is None:
            return self.chunk_tokens
        if self._last_chunk is None:
            tokens = FIRST_BUDGETED_TOKENS
        else:
            last_tokens, last_s = self._last_chunk
            scale = min(1.25, max(0.5, budget_s / max(last_s, 1e-6)))
            tokens = int(last_tokens * scale)
            if scale > 1.0:  # truncation would keep a 1-3 token chunk from ever growing
                tokens = max(tokens, last_tokens + 1)
        return max(min(MIN_CHUNK_TOKENS, self.chunk_tokens), min(self.chunk_tokens, tokens))

    def _measured(self, num_tokens: int, start_s: float) -> None:
        self._last_chunk = (num_tokens, time.perf_counter() - start_s)

    def __len__(self) -> int:
        return len(self.waiting)

    def push(self, request: Request) -> None:
        self.waiting.append(request)

    def push_front(self, requests: list[Request]) -> None:
        """Requests evicted from rows: ahead of every waiter, in arrival order."""
        for request in sorted(requests, key=lambda r: r.arrival_seq, reverse=True):
            _rewind(request)
            self.waiting.appendleft(request)

    @property
    def prefilling(self) -> list[Request]:
        """Waiters holding KV: their prefill started (a prompt-cache prefix, or chunks)."""
        if not self._caches:
            return []
        return [r for r in self.waiting if r.request_id in self._caches]

    def drop_prefill(self, request: Request) -> list[RaggedKVCache]:
        """Give up a waiter's partial prefill (its KV is wanted for rows); its caches, to offer back."""
        _rewind(request)
        return self._caches.pop(request.request_id)

    def remove(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._caches.pop(request_id, None)
                return request
        return None

    def can_join_next_drain(self, budget_s: float | None = None) -> bool:
        """True when the first waiter's prompt completes within one drain's budget, so a
        preempt for it lets it join at once (a longer one is prefilled ahead first)."""
        request = self.waiting[0]
        if request.request_id not in self._caches:
            self._caches[request.request_id] = self._start(request)
        return request.num_prefill_tokens - request.num_prefilled <= self.token_budget(budget_s)

    def prefill_ahead(self, budget_s: float | None = None) -> None:
        """Spend one chunk on the first waiter without finishing its prompt (the running
        stream keeps speculating meanwhile)."""
        assert not self.can_join_next_drain(budget_s)
        request = self.waiting[0]
        caches = self._caches[request.request_id]
        request.status = RequestStatus.PREFILLING
        start_s, start = time.perf_counter(), request.num_prefilled
        num_tokens = self.token_budget(budget_s)
        chunk = mx.array(request.all_token_ids[start : start + num_tokens], dtype=mx.int32)[None]
        self._score_prompt(request, self.target.body(chunk, caches), start)
        request.num_prefilled += num_tokens
        mx.eval([c.keys for c in caches])
        self._measured(num_tokens, start_s)

    def plan_packed_chunks(self, max_new_rows: int, budget_s: float | None = None) -> list[PackedChunk]:
        """The waiters' next chunks within one budget, in arrival order, to ride a decode
        forward: whole prompts while they fit (they join together), then at most one part."""
        chunks: list[PackedChunk] = []
        budget = self.token_budget(budget_s)
        for request in self.waiting:
            if budget <= 0 or len(chunks) >= max_new_rows:
                break
            caches = self._prefilling_caches(request)
            start = request.num_prefilled
            num_tokens = min(budget, request.num_prefill_tokens - start)
            chunks.append(PackedChunk(request, caches, start, num_tokens))
            budget -= num_tokens
            if not chunks[-1].is_last:
                break
        return chunks

    def run_packed_chunk(self, chunk: PackedChunk, chunk_hidden: mx.array) -> None:
        """Account a dispatched chunk (chunk_hidden (1, T, D), lazy); the last one leaves the
        queue with its first token sampled (still lazy: read by land())."""
        request = chunk.request
        assert self.waiting and self.waiting[0] is request and request.num_prefilled == chunk.start
        self._score_prompt(request, chunk_hidden, chunk.start)
        request.num_prefilled += chunk.num_tokens
        if chunk.is_last:
            self.waiting.popleft()
            self._caches.pop(request.request_id, None)
            chunk.last_hidden = chunk_hidden[:, -1:, :]
            chunk.first_token = self._sample_first(request, chunk.last_hidden)

    def measured_packed(self, num_tokens: int, extra_s: float) -> None:
        """A packed chunk's cost: what its forward took beyond a decode round."""
        self._last_chunk = (num_tokens, max(extra_s, MIN_PACKED_CHUNK_S))

    @staticmethod
    def land(chunk: PackedChunk) -> Prefilled:
        """The prompt a last chunk finished, its first token read (waits for its forward)."""
        assert chunk.is_last and chunk.first_token is not None
        mx.eval(chunk.first_token, chunk.last_hidden)
        return Prefilled(chunk.request, chunk.caches, int(chunk.first_token.item()), chunk.last_hidden[0, 0])

    def drain(self, max_new_rows: int, budget_s: float | None = None) -> list[Prefilled]:
        """Prefill up to one budget of waiting prompts (token_budget(budget_s)), in arrival order."""
        done: list[Prefilled] = []
        budget = self.token_budget(budget_s)
        while self.waiting and budget > 0 and len(done) < max_new_rows:
            request = self.waiting[0]
            caches = self._prefilling_caches(request)
            remaining = request.num_prefill_tokens - request.num_prefilled
            num_tokens = min(budget, remaining)
            start_s, start = time.perf_counter(), request.num_prefilled
            chunk = mx.array(request.all_token_ids[start : start + num_tokens], dtype=mx.int32)[None]
            hidden = self.target.body(chunk, caches)  # (1, T, D)
            self._score_prompt(request, hidden, start)
            request.num_prefilled += num_tokens
            budget -= num_tokens
            if request.num_prefilled < request.num_prefill_tokens:
                mx.eval([c.keys for c in caches])
                self._measured(num_tokens, start_s)
                continue
            self.waiting.popleft()
            self._caches.pop(request.request_id, None)
            done.append(self._finish(request, caches, hidden[:, -1:, :]))
            self._measured(num_tokens, start_s)
        return done

    def _prefilling_caches(self, request: Request) -> list[RaggedKVCache]:
        """The request's partial prefill (started on first use, a prompt-cache prefix included)."""
        caches = self._caches.get(request.request_id)
        if caches is None:
            caches = self._caches[request.request_id] = self._start(request)
        request.status = RequestStatus.PREFILLING
        return caches

    def _start(self, request: Request) -> list[RaggedKVCache]:
        # Room for the prompt and the first decode steps: no growth copy while it prefills or just
        # after; never wider than the budget charges the row.
        min_capacity = min(request.num_prefill_tokens + 64, self.reserved_tokens(request))
        if self.prompt_cache is not None and not request.is_scoring_prompt:
            caches, num_cached = self.prompt_cache.fetch(request.all_token_ids)
            if caches is not None:
                request.num_prefilled = num_cached
                if not request.num_generated:  # a fresh prompt's reuse, not an evicted row's own KV back
                    request.num_cached_prompt = num_cached
                for cache in caches:
                    cache.min_capacity = min_capacity
                return caches
        return make_ragged_cache(self.target.num_layers, min_capacity=min_capacity, stored_dtype=self.target.kv_dtype)

    def _finish(self, request: Request, caches, last_hidden: mx.array) -> Prefilled:
        token = self._sample_first(request, last_hidden)
        mx.eval(token, last_hidden, [c.keys for c in caches])
        return Prefilled(request, caches, int(token.item()), last_hidden[0, 0])

    def _score_prompt(self, request: Request, hidden: mx.array, start: int) -> None:
        """Where the request asks for its prompt's logprobs: those of this chunk's positions
        (hidden (1, T, D) from position start) whose next token is a prompt token."""
        if not request.is_scoring_prompt:
            return
        num_positions = min(hidden.shape[1], request.num_prompt_tokens - 1 - start)
        if num_positions > 0:
            logprobs.keep_prompt(request, self.target.head(hidden[:, :num_positions]), start)

    def _sample_first(self, request: Request, last_hidden: mx.array) -> mx.array:
        """The request's next token (1, 1) from its prefill's last hidden state (1, 1, D): its
        first, or after an eviction the one after those it generated."""
        logits = self.target.head(last_hidden)  # (1, 1, V)
        rows = SamplingRows.make([request.params], [request.seed], [request.min_tokens_floor])
        position = mx.array([[request.num_prefill_tokens]], dtype=mx.int32)
        # Every generated token precedes it (an evicted or carried-over row's, prefilled again).
        repeats = repeat_counts([request], [False], None) if rows.is_penalized else None
        token = sample(logits, rows, position, repeats)
        logprobs.keep([request], logits, token, [request.num_prefill_tokens])
        return token


def _rewind(request: Request) -> None:
    """A request whose KV is gone waits again, to be prefilled from its first token."""
    request.status = RequestStatus.WAITING
    request.num_prefilled = 0


def width_cap(configured: int | None, drafter, calibrated: int | None = None) -> int:
    """The cap in force this round: env override, else the model's, else the calibration's
    (spec/calibration.py), else the drafter's default."""
    override = config.width_cap_override()
    if override is not None:
        return override
    if configured is not None:
        return configured
    if calibrated is not None:
        return calibrated
    return drafter.default_width_cap if drafter is not None else 0


def is_within_cap(cap: int, width: int) -> bool:
    return cap == 0 or width <= cap


def can_resume(requests: list[Request]) -> bool:
    """Re-arm only if some row has enough budget left for the capture round to pay off:
    rows with fewer than GMLX_RESUME_MIN_BUDGET tokens left do not count."""
    threshold = config.resume_min_budget()
    return config.is_resume_enabled() and any(r.num_remaining >= threshold for r in requests)
