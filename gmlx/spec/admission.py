"""Between rounds: the injection drain (chunked prefill of waiters), the width cap, resume.

The injection queue holds requests not yet prefilled. A drain spends a token budget on
prefill chunks; a request whose prompt is fully in its KV gets its first token sampled
from the prefill and is handed back to join the batch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import mlx.core as mx

from gmlx import config
from gmlx.cache.ragged import RaggedKVCache, make_ragged_cache
from gmlx.models.loader import LoadedModel
from gmlx.request import Request, RequestStatus
from gmlx.sampling import SamplingRows, sample


@dataclass(frozen=True)
class Prefilled:
    request: Request
    caches: list[RaggedKVCache]  # the whole prompt, one row
    first_token: int  # delivered; the row's pending token
    hidden: mx.array  # (D,) the hidden state that produced first_token


class InjectionQueue:
    def __init__(self, target: LoadedModel, chunk_tokens: int, prompt_cache=None):
        self.target = target
        self.chunk_tokens = chunk_tokens
        self.prompt_cache = prompt_cache
        self.waiting: collections.deque[Request] = collections.deque()
        self._caches: dict[str, list[RaggedKVCache]] = {}  # request id -> partial prefill

    def __len__(self) -> int:
        return len(self.waiting)

    def push(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._caches.pop(request_id, None)
                return request
        return None

    def drain(self, max_new_rows: int) -> list[Prefilled]:
        """Prefill up to one chunk budget of waiting prompts, in arrival order."""
        done: list[Prefilled] = []
        budget = self.chunk_tokens
        while self.waiting and budget > 0 and len(done) < max_new_rows:
            request = self.waiting[0]
            caches = self._caches.get(request.request_id)
            if caches is None:
                caches = self._start(request)
            request.status = RequestStatus.PREFILLING
            remaining = request.num_prompt_tokens - request.num_prefilled
            num_tokens = min(budget, remaining)
            start = request.num_prefilled
            chunk = mx.array(request.prompt_token_ids[start : start + num_tokens], dtype=mx.int32)[None]
            hidden = self.target.body(chunk, caches)  # (1, T, D)
            request.num_prefilled += num_tokens
            budget -= num_tokens
            if request.num_prefilled < request.num_prompt_tokens:
                mx.eval([c.keys for c in caches])
                self._caches[request.request_id] = caches
                continue
            self.waiting.popleft()
            self._caches.pop(request.request_id, None)
            done.append(self._finish(request, caches, hidden[:, -1:, :]))
        return done

    def _start(self, request: Request) -> list[RaggedKVCache]:
        if self.prompt_cache is not None:
            caches, num_cached = self.prompt_cache.fetch(request.prompt_token_ids)
            if caches is not None:
                request.num_prefilled = request.num_cached_prompt = num_cached
                return caches
        return make_ragged_cache(self.target.num_layers)

    def _finish(self, request: Request, caches, last_hidden: mx.array) -> Prefilled:
        logits = self.target.head(last_hidden)  # (1, 1, V)
        rows = SamplingRows.make([request.params], [request.seed])
        position = mx.array([[request.num_prompt_tokens]], dtype=mx.int32)
        token = sample(logits, rows, position)
        mx.eval(token, last_hidden, [c.keys for c in caches])
        return Prefilled(request, caches, int(token.item()), last_hidden[0, 0])


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
    """Re-arm only if some row has enough budget left for the capture round to pay off."""
    threshold = config.resume_min_budget()
    return config.is_resume_enabled() and any(r.num_remaining > threshold for r in requests)
