"""Checking a GENERATE message before it is accepted; every error names the field."""

from __future__ import annotations

from dataclasses import dataclass

from gmlx.request import SamplingParams
from ipc import messages as m
from ipc.bus import BusPayload


class InvalidRequest(ValueError):
    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_prompt_tokens: int  # the context (minus one token to generate) or the bus slot, the smaller


def validate_generate(msg: m.Generate, tokenizer, limits: ModelLimits) -> tuple[BusPayload, tuple[str, ...]]:
    """The bus payload and stop strings of a valid request; InvalidRequest otherwise."""
    stop = tuple(msg.stop or ())
    params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                            top_k=msg.top_k, min_p=msg.min_p, seed=msg.seed, stop=stop)
    try:
        params.validate()
    except ValueError as e:
        raise InvalidRequest(str(e), m.field_of(str(e))) from None
    if (msg.prompt is None) == (msg.token_ids is None):
        raise InvalidRequest("prompt: give exactly one of prompt or token_ids", "prompt")
    if msg.prompt is not None:
        field = "prompt"
        try:
            token_ids = list(tokenizer.encode(msg.prompt))
        except Exception as e:  # user text the tokenizer chokes on ends only this request
            raise InvalidRequest(f"prompt: cannot be tokenized ({type(e).__name__}: {e})", field) from None
    else:
        field = "token_ids"
        token_ids = msg.token_ids
        bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids: {bad} is not a token id in [0, {limits.vocab_size})", field)
    if not token_ids:
        raise InvalidRequest(f"{field}: the prompt is empty", field)
    if len(token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"{field}: {len(token_ids)} prompt tokens exceed the limit of "
                             f"{limits.max_prompt_tokens}", field)
    payload = BusPayload(token_ids=token_ids, max_tokens=params.max_tokens, temperature=float(params.temperature),
                         top_p=float(params.top_p), top_k=params.top_k, min_p=float(params.min_p), seed=params.seed)
    return payload, stop
