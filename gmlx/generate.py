"""Library mode: stream one request through an in-process engine, with text and stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from gmlx.request import RequestStatus, SamplingParams, check_text
from gmlx.textstream import TextStream


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]  # the new tokens of this chunk, in order
    text: str  # the new text of this chunk
    finish_reason: str | None = None  # None until the last chunk
    stats: dict | None = None  # on the last chunk
    logprobs: tuple | None = None  # where params.logprobs is set: a gmlx.logprobs.TokenLogprob per token


def render_chat(tokenizer, messages: list[dict]) -> str:
    """`messages` (role/content dicts) as prompt text, through the tokenizer's chat template."""
    if not messages:
        raise ValueError("messages: must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stream_generate(engine, prompt: str | None = None, params: SamplingParams | None = None,
                    token_ids: list[int] | None = None) -> Iterator[Chunk]:
    """Run one request to completion on `engine`, yielding chunks as rounds produce tokens.

    Other requests already in the engine keep decoding alongside this one.
    """
    params = params or SamplingParams()
    if token_ids is None:
        if not prompt:
            raise ValueError("prompt: must be a non-empty string")
        check_text("prompt", prompt)
        token_ids = engine.tokenizer.encode(prompt)
    request_id = engine.add_request(token_ids, params)
    text = TextStream(engine.tokenizer, params.stop)
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                kept, delta = text.take(output.new_token_ids, is_final=output.finish_reason is not None)
                logprobs = None if output.logprobs is None else output.logprobs[: len(kept)]
                if text.is_stopped:
                    final = engine.abort_request(request_id, RequestStatus.FINISHED_STOPPED, is_queued=False)
                    stats = dict(final.stats if final is not None else output.stats)
                    stats["generated_tokens"] -= len(output.new_token_ids) - len(kept)  # dropped past the stop
                    yield Chunk(kept, delta, "stop", stats, logprobs)
                    return
                yield Chunk(kept, delta, output.finish_reason, output.stats if output.finish_reason else None, logprobs)
                if output.finish_reason is not None:
                    return
    finally:
        engine.abort_request(request_id)  # a no-op once finished; cancels if the caller left early

