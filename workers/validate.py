"""Checking a GENERATE message before it is accepted; every error names the field.

Cheap limits come first (sizes, counts, integer ranges), so a hostile request is refused
before it costs tokenizer time; docs/protocol.md, "Limits", lists every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gmlx.request import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS, SamplingParams
from ipc import messages as m
from ipc.bus import BusPayload

MAX_MAX_TOKENS = 1 << 20  # documented cap; the bus field is u32, the context caps it further anyway
MAX_TOP_K = 1 << 24  # far above any vocabulary; the bus field is u32
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256  # per stop string, UTF-8
MAX_PROMPT_BYTES = 256 << 10  # UTF-8 bytes of `prompt`, whatever the model's context
MAX_CHAT_MESSAGES = 256  # entries of `messages`
MAX_ROLE_BYTES = 64  # UTF-8 bytes of one message's `role`
assert MAX_MAX_TOKENS <= m.U32_MAX and MAX_TOP_K <= m.U32_MAX
assert (m.MAX_LOGIT_BIAS_ENTRIES, m.MAX_STOP_TOKEN_IDS) == (MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS)


class InvalidRequest(ValueError):
    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_prompt_tokens: int  # the context (minus one token to generate) or the bus slot, the smaller
    max_prompt_bytes: int = MAX_PROMPT_BYTES  # a longer prompt cannot fit max_prompt_tokens (see prompt_byte_limit)


def prompt_byte_limit(max_prompt_tokens: int, max_token_bytes: int) -> int:
    """The longest prompt worth tokenizing: no token covers more than max_token_bytes of
    text, so a longer prompt has more than max_prompt_tokens tokens."""
    return min(MAX_PROMPT_BYTES, max_prompt_tokens * max(1, max_token_bytes))


def sampling_params(sampling: m.Sampling, stop: tuple[str, ...] = ()) -> SamplingParams:
    """The engine's SamplingParams of a wire Sampling: the one place the two meet, by field name."""
    return SamplingParams(**msgspec.structs.asdict(sampling), stop=stop)


def validate_generate(msg: m.Generate, tokenizer, limits: ModelLimits) -> tuple[BusPayload, tuple[str, ...]]:
    """The bus payload and stop strings of a valid request; InvalidRequest otherwise."""
    _check_limits(msg, limits)
    stop = tuple(msg.stop or ())
    sampling = m.sampling_of(msg)
    try:
        sampling_params(sampling, stop).validate()
    except ValueError as e:
        raise InvalidRequest(str(e), m.field_of(str(e))) from None
    num_inputs = sum(x is not None for x in (msg.prompt, msg.token_ids, msg.messages))
    if num_inputs != 1:
        raise InvalidRequest("prompt: give exactly one of prompt, token_ids or messages", "prompt")
    if msg.token_ids is None:
        field, token_ids = _encode(msg.prompt, msg.messages, tokenizer)
    else:
        field = "token_ids"
        token_ids = msg.token_ids
        _check_vocabulary(field, token_ids, limits)
    _check_vocabulary("logit_bias", sampling.logit_bias or (), limits)
    _check_vocabulary("stop_token_ids", sampling.stop_token_ids, limits)
    if not token_ids:
        raise InvalidRequest(f"{field}: the prompt is empty", field)
    if len(token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"{field}: {len(token_ids)} prompt tokens exceed the limit of "
                             f"{limits.max_prompt_tokens}", field)
    return BusPayload(token_ids=token_ids, sampling=sampling), stop


def tokenize(msg: m.Tokenize, tokenizer, limits: ModelLimits) -> list[int]:
    """TOKENIZE's token ids: what a GENERATE with the same prompt or messages prefills (however
    long: a count is what a caller often wants to know); InvalidRequest otherwise."""
    if (msg.prompt is None) == (msg.messages is None):
        raise InvalidRequest("prompt: give exactly one of prompt or messages", "prompt")
    _check_text_limits(msg.prompt, msg.messages, limits)
    return _encode(msg.prompt, msg.messages, tokenizer)[1]


def detokenize(msg: m.Detokenize, decoder, limits: ModelLimits) -> str:
    """DETOKENIZE's text, special tokens kept as the streams keep them; InvalidRequest otherwise."""
    _check_vocabulary("token_ids", msg.token_ids, limits)
    try:
        return decoder.decode(msg.token_ids)
    except Exception as e:  # an id the model has and its tokenizer lacks (padded vocabularies)
        raise InvalidRequest(f"token_ids: cannot be decoded ({type(e).__name__}: {e})", "token_ids") from None


def _encode(prompt: str | None, messages: list[m.ChatMessage] | None, tokenizer) -> tuple[str, list[int]]:
    """(the field, the token ids) of a prompt text or a chat, exactly one of them given."""
    if messages is not None:
        return "messages", _render_chat(messages, tokenizer)
    try:
        return "prompt", list(tokenizer.encode(prompt))
    except Exception as e:  # user text the tokenizer chokes on ends only this request
        raise InvalidRequest(f"prompt: cannot be tokenized ({type(e).__name__}: {e})", "prompt") from None


def _check_vocabulary(field: str, token_ids, limits: ModelLimits) -> None:
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: {bad} is not a token id in [0, {limits.vocab_size})", field)


def _render_chat(messages: list[m.ChatMessage], tokenizer) -> list[int]:
    """Token ids of the chat rendered with the model's template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages: the model has no chat template; send prompt or token_ids", "messages")
    turns = [{"role": turn.role, "content": turn.content} for turn in messages]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        # The template writes any BOS itself, so no special tokens are added on encoding.
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:  # a template may refuse roles or orders; that ends only this request
        raise InvalidRequest(f"messages: cannot be rendered with the chat template "
                             f"({type(e).__name__}: {e})", "messages") from None


def _check_limits(msg: m.Generate, limits: ModelLimits) -> None:
    """Sizes and integer ranges: constant time per field, before anything is tokenized."""
    for name, maximum in (("max_tokens", MAX_MAX_TOKENS), ("top_k", MAX_TOP_K)):
        value = getattr(msg, name)
        if isinstance(value, int) and value > maximum:  # the type itself is SamplingParams' to check
            raise InvalidRequest(f"{name} must be <= {maximum}, got {value}", name)
    _check_text_limits(msg.prompt, msg.messages, limits)
    if msg.token_ids is not None and len(msg.token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"token_ids: {len(msg.token_ids)} prompt tokens exceed the limit of "
                             f"{limits.max_prompt_tokens}", "token_ids")
    if msg.stop is not None:
        if len(msg.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: {len(msg.stop)} stop strings, over the limit of {MAX_STOP_STRINGS}", "stop")
        for s in msg.stop:
            if isinstance(s, str) and len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
                raise InvalidRequest(f"stop: a stop string over {MAX_STOP_BYTES} bytes", "stop")


def _check_text_limits(prompt: str | None, messages: list[m.ChatMessage] | None, limits: ModelLimits) -> None:
    """A prompt or a chat is held to the prompt's byte limit before it is tokenized."""
    if prompt is not None:
        # len() counts characters, each at least one byte: only a near-limit prompt is encoded.
        num_bytes = len(prompt)
        if num_bytes <= limits.max_prompt_bytes < 4 * num_bytes:
            num_bytes = len(prompt.encode("utf-8", "surrogatepass"))
        if num_bytes > limits.max_prompt_bytes:
            raise InvalidRequest(f"prompt: over {limits.max_prompt_bytes} bytes, more than the "
                                 f"{limits.max_prompt_tokens}-token limit can hold", "prompt")
    if messages is not None:
        _check_chat_limits(messages, limits)


def _check_chat_limits(messages: list[m.ChatMessage], limits: ModelLimits) -> None:
    """A chat is held to the prompt's byte limit (all contents together) before it is rendered."""
    if not messages:
        raise InvalidRequest("messages: the list is empty", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages, over the limit of {MAX_CHAT_MESSAGES}", "messages")
    num_chars = sum(len(turn.content) for turn in messages)
    if num_chars > limits.max_prompt_bytes:  # each character takes at least one byte
        num_bytes = num_chars
    else:
        num_bytes = sum(len(turn.content.encode("utf-8", "surrogatepass")) for turn in messages)
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidRequest(f"messages: contents over {limits.max_prompt_bytes} bytes, more than the "
                             f"{limits.max_prompt_tokens}-token limit can hold", "messages")
    for turn in messages:
        if len(turn.role.encode("utf-8", "surrogatepass")) > MAX_ROLE_BYTES:
            raise InvalidRequest(f"messages: a role over {MAX_ROLE_BYTES} bytes", "messages")
