"""OpenAI request bodies -> gmlx generate arguments, and gmlx chunks -> OpenAI response objects.

No sockets and no HTTP here: the gateway (workers/http_gateway.py) parses a body with
`parse_completion` / `parse_chat`, sends `GenerateArgs` through ipc.client, and shapes what
comes back with the `*_chunk` / `*_response` builders. A chat's messages go to the front-end as
they are: it renders them with the model's own tokenizer and template, as for a ZeroMQ client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass

from gmlx.request import MAX_TOP_LOGPROBS, check_text

# Choices one request may ask for (prompts x n): each is a request of its own to the server.
MAX_CHOICES = 16

# Fields OpenAI defines that change the output and that gmlx cannot honour: refused, not ignored.
_UNSUPPORTED_IF_SET = {"suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"})}
_MAX_TOKEN_ID_DIGITS = 10  # a u32; the server checks the vocabulary


class BadRequest(ValueError):
    """A request the gateway refuses; `param` names the body field, `status` the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class GenerateArgs:
    """What one OpenAI request asks of ipc.client's generate."""

    model: str
    prompt: str | None
    token_ids: tuple[int, ...] | None
    messages: tuple[tuple[str, str], ...] | None  # chat: (role, text) turns, rendered by the front-end
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    is_stream: bool
    is_usage_chunk: bool  # stream_options.include_usage: a last chunk with usage and no choices
    is_speculate: bool  # gmlx extra: False pins the row to plain decoding (never the tokens)
    num_logprobs: int | None  # None: no logprobs; N: each token's and its position's N likeliest
    is_echo: bool = False  # completions: the answer starts with the prompt (its logprobs too, where asked)
    presence_penalty: float = 0.0  # checked by the server (SamplingParams), named there
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias); the server checks both
    repetition_penalty: float = 1.0  # vLLM's extras, checked by the server
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    num_per_prompt: int = 1  # samples drawn of each prompt: OpenAI's best_of, n where it is not given
    num_returned: int = 1  # OpenAI's n: of those, the ones with the highest logprob per token are answered
    more_prompts: tuple = ()  # completions: a batch's prompts after the first, each (text, token ids)
    is_ranked: bool = False  # best_of > n: each sample's token logprobs are asked for, to rank it

    def choices(self) -> list[GenerateArgs]:
        """One request's arguments per choice, in OpenAI's index order (prompt by prompt, n each):
        sample j of a seeded request has seed + j, so every choice is reproducible on its own."""
        prompts = [(self.prompt, self.token_ids), *self.more_prompts]
        return [dataclasses.replace(self, prompt=prompt, token_ids=token_ids, num_per_prompt=1, num_returned=1,
                                    more_prompts=(),
                                    seed=None if self.seed is None else (self.seed + j) % 2**63)
                for prompt, token_ids in prompts for j in range(self.num_per_prompt)]

    def client_kwargs(self) -> dict:
        """ipc.client's generate() arguments."""
        messages = None if self.messages is None else [{"role": r, "content": c} for r, c in self.messages]
        return dict(prompt=self.prompt, token_ids=None if self.token_ids is None else list(self.token_ids),
                    messages=messages, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=list(self.stop) or None,
                    speculate=self.is_speculate,
                    logprobs=0 if self.num_logprobs is None and self.is_ranked else self.num_logprobs,
                    prompt_logprobs=self.num_prompt_logprobs, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
                    repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
                    min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Echo scores the prompt where logprobs are asked; a token-id prompt's text is made of its
        tokens' own texts, which the prompt's logprobs carry."""
        if not self.is_echo:
            return None
        if self.num_logprobs is not None:
            return self.num_logprobs
        return None if self.prompt is not None else 0

    def echoed(self, chunk, is_first: bool) -> tuple[str, list | None]:
        """A chunk's text and logprobs entries as the answer shows them: the first one's led by the
        prompt's where echo is on."""
        if not (self.is_echo and is_first):
            return chunk.text, chunk.logprobs
        prompt_entries = chunk.prompt_logprobs or []
        prefix = self.prompt if self.prompt is not None else "".join(e["token"] for e in prompt_entries)
        if self.num_logprobs is None:
            return prefix + chunk.text, chunk.logprobs
        return prefix + chunk.text, prompt_entries + (chunk.logprobs or [])


def parse_completion(body, default_max_tokens: int = 16) -> GenerateArgs:
    """POST /v1/completions: `prompt` is a string, a list of one string, or a list of token ids."""
    body = _object(body)
    prompt = body.get("prompt")
    # One prompt (text or token ids) or a batch of them (a list of texts or of token-id lists).
    is_batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = [_one_prompt(p) for p in (prompt if is_batch else [prompt])]
    # The legacy API's logprobs is the count of alternatives; 0 still scores the chosen tokens.
    num_logprobs = _top_count(body, "logprobs")
    is_echo = _get(body, "echo", False, _is_bool, "a boolean")
    args = _common(body, *prompts[0], None, default_max_tokens, num_logprobs, is_echo)
    return _with_choices(_with_best_of(body, args), prompts[1:])


def _with_best_of(body: dict, args: GenerateArgs) -> GenerateArgs:
    """best_of samples of each prompt, of which the n with the highest logprob per token are
    answered (OpenAI's legacy completions): only a whole answer can be ranked, so not streamed."""
    best_of = _get(body, "best_of", args.num_returned, _is_int, "an integer")
    if not args.num_returned <= best_of <= MAX_CHOICES:
        raise BadRequest(f"best_of must be in [n, {MAX_CHOICES}] (n = {args.num_returned}), got {best_of}", "best_of")
    if best_of > args.num_returned and args.is_stream:
        raise BadRequest("best_of above n cannot be streamed: the best are known only at the end", "best_of")
    return dataclasses.replace(args, num_per_prompt=best_of, is_ranked=best_of > args.num_returned)


def _one_prompt(prompt) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return _text(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return None, tuple(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either (a batch), "
                     f"got {_short(prompt)}", "prompt")


def _with_choices(args: GenerateArgs, more_prompts: list) -> GenerateArgs:
    num_choices = (1 + len(more_prompts)) * args.num_per_prompt
    if num_choices > MAX_CHOICES:
        param = "best_of" if args.is_ranked else "n"
        raise BadRequest(f"at most {MAX_CHOICES} samples a request (prompts x {param}), got {num_choices}", param)
    return dataclasses.replace(args, more_prompts=tuple(more_prompts))


def parse_chat(body, default_max_tokens: int) -> GenerateArgs:
    """POST /v1/chat/completions: each message's content a string or a list of text parts."""
    body = _object(body)
    turns = _chat_turns(body.get("messages"))
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    # Chat's logprobs is a switch and top_logprobs the count, which needs the switch on.
    is_logprobs = _get(body, "logprobs", False, _is_bool, "a boolean")
    num_top = _top_count(body, "top_logprobs")
    if num_top is not None and not is_logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if body.get("best_of") not in (None, 1):
        raise BadRequest(f"best_of is a completions field, not supported on chat, got {_short(body['best_of'])}",
                         "best_of")
    if body.get("echo") not in (None, False):
        raise BadRequest(f"echo is a completions field, not supported on chat, got {_short(body['echo'])}", "echo")
    num_logprobs = (num_top or 0) if is_logprobs else None
    return _with_choices(_common(body, None, None, turns, default_max_tokens, num_logprobs), [])


def _chat_turns(messages) -> tuple[tuple[str, str], ...]:
    """A chat's (role, text) turns; each message's content a string or a list of text parts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones can be rendered
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        _text(message["role"], "messages")
        _text(_text_of(content), "messages")
    return tuple((msg["role"], _text_of(msg["content"])) for msg in messages)


@dataclass(frozen=True, slots=True)
class TokenizeArgs:
    """POST /tokenize (vLLM's): a prompt or a chat to count and list the tokens of."""

    model: str | None
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None

    def client_kwargs(self) -> dict:
        messages = None if self.messages is None else [{"role": r, "content": c} for r, c in self.messages]
        return dict(prompt=self.prompt, messages=messages)


def parse_tokenize(body) -> TokenizeArgs:
    body = _object(body)
    model = _get(body, "model", None, _is_str, "a string")
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give exactly one of prompt (a string) or messages", "prompt")
    if "messages" in body:
        return TokenizeArgs(model, None, _chat_turns(body["messages"]))
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest(f"prompt must be a string, got {_short(prompt)}", "prompt")
    return TokenizeArgs(model, _text(prompt, "prompt"), None)


def parse_detokenize(body) -> tuple[str | None, list[int]]:
    """POST /detokenize (vLLM's): (model or None, the token ids to decode)."""
    body = _object(body)
    model = _get(body, "model", None, _is_str, "a string")
    tokens = body.get("tokens")
    if not _is_token_ids(tokens):
        raise BadRequest(f"tokens must be a list of token ids, got {_short(tokens)}", "tokens")
    return model, tokens


def _top_count(body: dict, name: str) -> int | None:
    count = _get(body, name, None, _is_int, "an integer")
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {count}", name)
    return count


def _common(body: dict, prompt, token_ids, messages, default_max_tokens: int,
            num_logprobs: int | None, is_echo: bool = False) -> GenerateArgs:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", "model")
    n = _get(body, "n", 1, _is_int, "an integer")
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    for name, allowed in _UNSUPPORTED_IF_SET.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by gmlx, got {_short(body[name])}", name)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {_short(body.get('stop'))}", "stop")
    for text in stop:
        _text(text, "stop")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return GenerateArgs(
        model=model, prompt=prompt, token_ids=token_ids, messages=messages,
        max_tokens=_get(body, "max_tokens", default_max_tokens, _is_int, "an integer"),
        temperature=_get(body, "temperature", 1.0, _is_number, "a number"),  # OpenAI's default, not gmlx's
        top_p=_get(body, "top_p", 1.0, _is_number, "a number"),
        top_k=_get(body, "top_k", 0, _is_int, "an integer"),
        min_p=_get(body, "min_p", 0.0, _is_number, "a number"),
        seed=_get(body, "seed", None, _is_int, "an integer"),
        stop=tuple(stop),
        is_stream=_get(body, "stream", False, _is_bool, "a boolean"),
        is_usage_chunk=_get(stream_options, "include_usage", False, _is_bool, "a boolean"),
        is_speculate=_get(body, "speculate", True, _is_bool, "a boolean"),
        num_logprobs=num_logprobs,
        is_echo=is_echo,
        num_per_prompt=n,
        num_returned=n,
        presence_penalty=_get(body, "presence_penalty", 0.0, _is_number, "a number"),
        frequency_penalty=_get(body, "frequency_penalty", 0.0, _is_number, "a number"),
        logit_bias=_logit_bias(body),
        repetition_penalty=_get(body, "repetition_penalty", 1.0, _is_number, "a number"),
        ignore_eos=_get(body, "ignore_eos", False, _is_bool, "a boolean"),
        min_tokens=_get(body, "min_tokens", 0, _is_int, "an integer"),
        stop_token_ids=tuple(_get(body, "stop_token_ids", [], _is_token_ids, "a list of token ids")),
    )


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias, an object of token ids written as text to numbers, as pairs; the
    values' range, the count and the ids' vocabulary are the server's to check and name."""
    bias = _get(body, "logit_bias", {}, lambda value: isinstance(value, dict), "an object")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_ID_DIGITS):
            raise BadRequest(f"logit_bias keys must be token ids, got {_short(key)}", "logit_bias")
        if not _is_number(value):
            raise BadRequest(f"logit_bias values must be numbers, got {_short(value)} for token {key}",
                             "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs) or None


def _get(body: dict, name: str, default, is_ok, kind: str):
    value = body.get(name)
    if value is None:
        return default
    if not is_ok(value):
        raise BadRequest(f"{name} must be {kind}, got {_short(value)}", name)
    return value


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _text(value: str, param: str) -> str:
    """value, where UTF-8 can carry it: JSON's escapes can spell a lone surrogate (\\ud800), which
    the ZeroMQ client cannot encode (the gateway answered 500 to it)."""
    try:
        check_text(param, value)
    except ValueError as e:
        raise BadRequest(str(e), param) from None
    return value


def _text_of(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_str(value) -> bool:
    return isinstance(value, str)


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def finish_reason_of(gmlx_reason: str | None) -> str | None:
    """gmlx's "stop" / "length" map one to one; "cancelled" (a drain that ran out of time) is a stop."""
    return gmlx_reason if gmlx_reason in (None, "stop", "length") else "stop"


def usage_of(stats: dict | None) -> dict:
    stats = stats or {}
    prompt_tokens = int(stats.get("prompt_tokens", 0))
    completion_tokens = int(stats.get("generated_tokens", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseShape:
    """The ids and envelope of one response, for the completion or the chat flavour; its choices
    are numbered by `index`."""

    def __init__(self, kind: str, model: str, request_id: str):
        assert kind in ("completion", "chat")
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}  # the completion flavour's text_offset of each choice's next token
        # A mid-stream event differs from the next only in its text: render the rest once.
        marker = "\x00"
        rendered = json.dumps(self.chunk(marker, None), separators=(",", ":"))
        self._event_head, self._event_tail = rendered.split(json.dumps(marker))  # exactly one marker

    def text_event(self, text: str) -> str:
        """The server-sent event of choice 0's mid-stream chunk with non-empty text (and no logprobs)."""
        return f"data: {self._event_head}{json.dumps(text)}{self._event_tail}\n\n"

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def chunk(self, text: str, finish_reason: str | None, usage: dict | None = None, is_first: bool = False,
              logprobs: list | None = None, index: int = 0) -> dict:
        """One server-sent event's object; logprobs: the gmlx chunk's entries, where the request asked."""
        choice_logprobs = None if logprobs is None else self.logprobs(logprobs, index)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if is_first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": choice_logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice], usage)
        choice = {"index": index, "text": text, "logprobs": choice_logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage)

    def response(self, choices: list[tuple[str, str | None, list | None]], usage: dict) -> dict:
        """The whole answer of a request that did not stream: (text, finish reason, logprobs
        entries or None) of each choice, in index order."""
        out = []
        for index, (text, finish_reason, logprobs) in enumerate(choices):
            choice_logprobs = None if logprobs is None else self.logprobs(logprobs, index)
            if self.kind == "chat":
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": choice_logprobs, "finish_reason": finish_reason})
            else:
                out.append({"index": index, "text": text, "logprobs": choice_logprobs, "finish_reason": finish_reason})
        return self._envelope("chat.completion" if self.kind == "chat" else "text_completion", out, usage)

    def logprobs(self, entries: list[dict], index: int = 0) -> dict:
        """OpenAI's logprobs object of gmlx's entries ({token_id, token, logprob, top_logprobs}):
        the chat flavour's `content` list, or the completion flavour's parallel lists, whose
        text_offset counts each token's own text from the answer's start (the prompt's, with echo)."""
        if self.kind == "chat":
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                                   "bytes": _bytes(t["token"])} for t in e["top_logprobs"]]}
                                for e in entries]}
        offsets, offset = [], self._text_offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        self._text_offsets[index] = offset
        # An echoed prompt's first token has no logprob and no alternatives: null, as OpenAI's.
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 for e in entries],
                "text_offset": offsets}


def best_of_each_prompt(answers: list, scores: list[float], num_per_prompt: int, num_returned: int) -> list:
    """Of each prompt's num_per_prompt answers (index order), the num_returned with the highest
    scores (mean token logprob), in the order of their scores; ties keep the earlier sample."""
    best = []
    for start in range(0, len(answers), num_per_prompt):
        order = sorted(range(start, start + num_per_prompt), key=lambda i: (-scores[i], i))
        best += [answers[i] for i in order[:num_returned]]
    return best


def mean_logprob(entries: list[dict]) -> float:
    """A completion's logprob per token: what best_of ranks its samples by."""
    return sum(e["logprob"] for e in entries) / len(entries) if entries else -math.inf


def usage_of_choices(stats: list[dict | None], num_per_prompt: int) -> dict:
    """A response's usage from its choices' final stats (index order): each prompt counted once,
    however many samples it has (n), every choice's completion tokens."""
    usages = [usage_of(s) for s in stats]
    prompt_tokens = sum(u["prompt_tokens"] for i, u in enumerate(usages) if i % num_per_prompt == 0)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))
