"""Named classes of HTTP requests for fuzzing a live OpenAI-compatible gateway, valid and hostile.

Each class is a function of (random.Random, model id) that returns an HttpCase; the hypothesis
test (tests/test_http_gateway.py) and the long-run script (scripts/fuzz_http.py) share them, as
frames.py's classes are shared for the ZeroMQ front-end. `send` makes the request on a raw
connection (any method, path, bytes and headers) and `problem` says what is wrong with a reply:
a server error, no reply, a valid request not served, or a refusal without OpenAI's error body.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from dataclasses import dataclass, field

from frames import weird_value

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
BODY_LIMIT_BYTES = 1 << 20  # ipc.messages.MAX_MESSAGE_BYTES: the gateway reads no further
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "speculate", "n",
             "stream_options", "max_completion_tokens", "logprobs", "top_logprobs", "echo", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "best_of", "ignore_eos", "min_tokens",
             "stop_token_ids", "user")


@dataclass(frozen=True)
class HttpCase:
    name: str  # the class it was drawn from
    method: str
    path: str
    body: bytes | None
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json"})
    is_valid: bool = False  # a well-formed generation: it must be served (200, a complete answer)
    is_stream: bool = False
    is_dropped: bool = False  # the client closes the connection after the reply's first bytes


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no status line (reset, closed, or timed out)
    body: bytes
    elapsed_s: float


def _valid_body(rng: random.Random, model_id: str, is_chat: bool) -> dict:
    body = {"model": model_id, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.0, 0.7, 1.0])}
    if is_chat:
        turns = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        content = rng.choice(["Hi", "héllo wörld ✓", "def f(", [{"type": "text", "text": "two "}, {"type": "text",
                                                                                            "text": "parts"}]])
        body["messages"] = turns + [{"role": "user", "content": content}]
    else:
        body["prompt"] = rng.choice(["Hello", "The cat sat on", "1 2 3 4", "héllo wörld ✓", ["import os"],
                                     [1, 2, 3], [[5, 6, 7]]])
    if rng.random() < 0.5:
        body.update(top_p=rng.choice([1.0, 0.9, 0.01]), top_k=rng.choice([0, 1, 40]),
                    min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, 0, 2**63 - 1, rng.getrandbits(32)]))
    if rng.random() < 0.3:
        body["stop"] = rng.choice(["\n", ["."], [".", "the", "é"]])
    if rng.random() < 0.3:
        body["speculate"] = rng.random() < 0.5
    if rng.random() < 0.2:
        body.update(presence_penalty=rng.choice([0, -2, 0.5, 2]), frequency_penalty=rng.choice([0.0, 1.5, -0.3]),
                    repetition_penalty=rng.choice([1, 1.3, 0.5]))
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randrange(1000)): rng.choice([-100, -2.5, 3, 100]) for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.15:
        body.update(min_tokens=rng.randint(0, body["max_tokens"]), ignore_eos=rng.random() < 0.5,
                    stop_token_ids=[rng.randrange(1000) for _ in range(rng.randint(0, 3))])
    if rng.random() < 0.25:  # chat's is a switch with a count beside it, the legacy API's a count
        if is_chat:
            body["logprobs"] = True
            if rng.random() < 0.5:
                body["top_logprobs"] = rng.choice([0, 1, 5, 20])
        else:
            body["logprobs"] = rng.choice([0, 1, 5, 20])
    if not is_chat and rng.random() < 0.15:
        body["echo"] = True
    if rng.random() < 0.15:  # several choices: n samples, or a batch of prompts
        if not is_chat and rng.random() < 0.5:
            body["prompt"] = [rng.choice(["Hello", "héllo wörld ✓", "1 2 3"]), [5, 6, 7]]
        else:
            body["n"] = rng.randint(2, 4)
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    elif not is_chat and rng.random() < 0.1:  # best_of: a whole answer, ranked, never streamed
        body["best_of"] = body.get("n", 1) + rng.randint(0, 2)
    return body


def _post(name: str, rng: random.Random, body: bytes, is_chat: bool | None = None, **kwargs) -> HttpCase:
    path = GENERATE_PATHS[rng.random() < 0.5] if is_chat is None else GENERATE_PATHS[is_chat]
    return HttpCase(name, "POST", path, body, **kwargs)


def _encode(body, is_ascii: bool = False) -> bytes:
    """JSON of body; a lone surrogate in it goes out as JSON's escape (is_ascii) or as the bytes
    UTF-8 would give it (surrogatepass), both of which Python's JSON parser reads back."""
    return json.dumps(body, ensure_ascii=is_ascii).encode("utf-8", "surrogatepass")


def valid_completion(rng, model_id):
    body = _valid_body(rng, model_id, is_chat=False)
    return _post("valid_completion", rng, _encode(body), False, is_valid=True, is_stream=bool(body.get("stream")))


def valid_chat(rng, model_id):
    body = _valid_body(rng, model_id, is_chat=True)
    return _post("valid_chat", rng, _encode(body), True, is_valid=True, is_stream=bool(body.get("stream")))


def tokenizer_route(rng, model_id):
    """/tokenize or /detokenize, well formed (served) or with one field broken (a 4xx)."""
    if rng.random() < 0.5:
        body = {"prompt": rng.choice(["Hello", "héllo wörld ✓", "x" * 40])} if rng.random() < 0.7 else \
            {"messages": [{"role": "user", "content": "Hi"}]}
        path = "/tokenize"
    else:
        body, path = {"tokens": [rng.randrange(256) for _ in range(rng.randint(0, 30))]}, "/detokenize"
    if rng.random() < 0.5:
        body["model"] = model_id
    is_valid = rng.random() < 0.6
    if not is_valid:
        body[rng.choice([*body, "prompt", "tokens", "model"])] = weird_value(rng)
    return HttpCase("tokenizer_route", "POST", path, _encode(body), is_valid=is_valid)


def weird_field(rng, model_id):
    is_chat = rng.random() < 0.5
    body = _valid_body(rng, model_id, is_chat)
    name = rng.choice([*_SAMPLING, "model", "messages" if is_chat else "prompt", "max_tokenz", ""])
    body[name] = weird_value(rng)
    return _post("weird_field", rng, _encode(body), is_chat)


def weird_message(rng, model_id):
    body = _valid_body(rng, model_id, is_chat=True)
    turn = rng.choice([weird_value(rng), {"role": weird_value(rng), "content": "x"},
                       {"role": "user", "content": weird_value(rng)}, {"content": "no role"},
                       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                       {"role": rng.choice(["tool", "assistant", "ROOT", ""]), "content": "x"}])
    body["messages"] = [turn] if rng.random() < 0.5 else body["messages"] + [turn]
    return _post("weird_message", rng, _encode(body), True)


def lone_surrogate(rng, model_id):
    is_chat = rng.random() < 0.5
    body = _valid_body(rng, model_id, is_chat)
    text = rng.choice(["\ud800", "a\udfffb", "\udc00" * 3])
    if is_chat:
        body["messages"][-1] = {"role": rng.choice(["user", text]), "content": text}
    elif rng.random() < 0.5:
        body["prompt"] = text
    else:
        body["stop"] = [text]
    return _post("lone_surrogate", rng, _encode(body, is_ascii=rng.random() < 0.5), is_chat)


def not_an_object(rng, model_id):
    body = rng.choice([[], [{"model": model_id, "prompt": "x"}], "prompt", 7, None, True, 1.5])
    return _post("not_an_object", rng, _encode(body))


def bad_json(rng, model_id):
    valid = _encode(_valid_body(rng, model_id, rng.random() < 0.5))
    body = rng.choice([
        b"", b"{", b"}", b"nul", b'{"model": }', valid[: rng.randint(1, len(valid) - 1)],
        valid + b"garbage", b"\xff\xfe\x00", b'{"prompt": "\xe9"}',
        b'{"model": "m", "prompt": "x", "temperature": NaN}', b'{"a": Infinity}',
        rng.choice([b"[", b'{"a":']) * rng.choice([100, 5_000, 200_000]),
        bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))])
    return _post("bad_json", rng, body)


def oversized(rng, model_id):
    filler = "x" * (BODY_LIMIT_BYTES + rng.randint(1, 4096))
    body = {"model": model_id, "prompt": filler} if rng.random() < 0.5 else {"pad": filler}
    return _post("oversized", rng, _encode(body))


def wrong_route(rng, model_id):
    method, path = rng.choice([("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/models"),
                               ("DELETE", "/health"), ("POST", "/v1/embeddings"), ("GET", "/v2/completions"),
                               ("GET", "/" + "a" * 2000), ("POST", "/v1/completions/../completions")])
    return HttpCase("wrong_route", method, path, _encode({"model": model_id}) if method != "GET" else None)


def odd_headers(rng, model_id):
    body = _valid_body(rng, model_id, is_chat=False)
    headers = rng.choice([{"Content-Type": "text/plain"}, {}, {"Content-Type": "application/json; charset=latin-1"},
                          {"Content-Type": "application/json", "Authorization": "Bearer " + "k" * 3000},
                          {"Content-Type": "application/json", "Accept": "nothing/known"}])
    return _post("odd_headers", rng, _encode(body), False, headers=headers, is_stream=bool(body.get("stream")))


def dropped_stream(rng, model_id):
    is_chat = rng.random() < 0.5
    body = {**_valid_body(rng, model_id, is_chat), "stream": True, "max_tokens": rng.choice([16, 200])}
    return _post("dropped_stream", rng, _encode(body), is_chat, is_stream=True, is_dropped=True)


CLASSES = {f.__name__: f for f in (
    valid_completion, valid_chat, tokenizer_route, weird_field, weird_message, lone_surrogate, not_an_object, bad_json, oversized,
    wrong_route, odd_headers, dropped_stream)}
# Served (a complete 200 answer) or refused (4xx with an error body), never anything else.
REFUSED = frozenset({"lone_surrogate", "not_an_object", "bad_json", "oversized", "wrong_route"})
_WEIGHTS = [3.0 if name in ("valid_completion", "valid_chat", "weird_field") else 1.0 for name in CLASSES]


def draw(rng: random.Random, model_id: str, name: str | None = None) -> HttpCase:
    if name is None:
        name = rng.choices(list(CLASSES), _WEIGHTS)[0]
    return CLASSES[name](rng, model_id)


def send(host: str, port: int, case: HttpCase, timeout_s: float = 60.0) -> Reply:
    """The case's request on a fresh connection; the whole reply, or its first bytes when dropped."""
    start_s = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(case.method, case.path, body=case.body, headers=case.headers)
        response = conn.getresponse()
        body = response.read(1) if case.is_dropped else response.read()
        return Reply(response.status, body, time.monotonic() - start_s)
    except (ConnectionError, socket.timeout, http.client.HTTPException):
        return Reply(None, b"", time.monotonic() - start_s)
    finally:
        conn.close()  # a dropped stream's connection closes mid-reply


def problem(case: HttpCase, reply: Reply) -> str | None:
    """What is wrong with the reply, or None."""
    if reply.status is None:
        return "no reply"
    if reply.status >= 500:
        return f"server error {reply.status}: {reply.body[:200]!r}"
    if case.is_dropped:
        return None
    if case.is_valid and reply.status != 200:
        return f"valid request refused {reply.status}: {reply.body[:200]!r}"
    if case.name in REFUSED and reply.status < 400:
        return f"hostile request answered {reply.status}"
    if reply.status == 200:
        return _answer_problem(case, reply.body)
    return _error_body_problem(reply.body)


def _answer_problem(case: HttpCase, body: bytes) -> str | None:
    if case.path not in GENERATE_PATHS:
        return None
    if case.is_stream or body.startswith(b"data: "):
        events = [e for e in body.decode("utf-8").split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]":
            return f"stream without [DONE]: {body[-200:]!r}"
        last = [json.loads(e[len("data: "):]) for e in events[:-1]]
        if any("error" in e for e in last):
            return f"stream ended in an error: {body[-300:]!r}"
        choices = [c for e in last for c in e.get("choices", [])]
        # Every choice ends once, with stop or length (several choices' events interleave).
        finishes = {c["index"]: c["finish_reason"] for c in choices if c.get("finish_reason") is not None}
        if not choices or set(finishes) != {c["index"] for c in choices}:
            return f"a choice of the stream never finished: {sorted(finishes)}"
        if any(f not in ("stop", "length") for f in finishes.values()):
            return f"stream finish {sorted(finishes.values())}"
        usage = next(e["usage"] for e in last if e.get("choices") and e["choices"][0].get("finish_reason"))
        return _logprobs_problem(case, choices, usage)
    answer = json.loads(body)
    finishes = [c["finish_reason"] for c in answer["choices"]]
    if not finishes or any(f not in ("stop", "length") for f in finishes):
        return f"finish_reason {finishes!r}"
    return _logprobs_problem(case, answer["choices"], answer["usage"])


def _logprobs_problem(case: HttpCase, choices: list[dict], usage: dict) -> str | None:
    """Where a valid request asked for logprobs: one entry per completion token, else none at all."""
    if not case.is_valid:
        return None
    body = json.loads(case.body)
    value = body.get("logprobs")
    asked = value is not None and value is not False  # the legacy API's 0 asks, chat's false does not
    objects = [c["logprobs"] for c in choices if c.get("logprobs") is not None]
    if not asked:
        return None if not objects else "logprobs nobody asked for"
    indexes = {c["index"] for c in choices}
    if {c["index"] for c in choices if c.get("logprobs") is not None} != indexes:
        return "a choice without logprobs"
    if len(indexes) > 1:  # echo repeats a prompt in each of its samples: count one choice's only
        return None
    if body.get("best_of", 1) > body.get("n", 1):  # usage counts every sample, the answer holds one
        return None
    is_chat = case.path == GENERATE_PATHS[1]
    num_entries = sum(len(o["content"] if is_chat else o["token_logprobs"]) for o in objects)
    num_tokens = usage["completion_tokens"] + (usage["prompt_tokens"] if body.get("echo") else 0)
    if num_entries != num_tokens:
        return f"{num_entries} logprobs for {num_tokens} tokens"
    return None


def _error_body_problem(body: bytes) -> str | None:
    try:
        error = json.loads(body)["error"]
        if isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str):
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"refusal without an OpenAI error body: {body[:200]!r}"
