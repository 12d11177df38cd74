"""Named classes of client frames for fuzzing a live front-end, valid and hostile.

Each class is a function of a random.Random that returns a FuzzFrame; the hypothesis test
(tests/test_serving_fuzz.py) and the long-run script (scripts/fuzz_frontend.py) share them,
so the table in BENCHMARKS.md and the test speak of the same classes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import msgspec

from ipc import messages as m

VOCAB_SIZE_GUESS = 256  # token ids below this are valid for the built-in model and the tiny ones
SAMPLING_FIELDS = m.Sampling.__struct_fields__
ALL_FIELDS = ("ref", "prompt", "token_ids", "messages", "stop") + SAMPLING_FIELDS


@dataclass(frozen=True)
class FuzzFrame:
    name: str  # the class it was drawn from
    frames: list[bytes]
    is_valid: bool  # a well-formed GENERATE or STATS: the server must serve it


def _ref(rng: random.Random) -> str:
    return f"f{rng.getrandbits(48):x}"


def _valid_fields(rng: random.Random) -> dict:
    fields = {"ref": _ref(rng), "max_tokens": rng.randint(1, 6)}
    if rng.random() < 0.5:
        fields["token_ids"] = [rng.randrange(VOCAB_SIZE_GUESS) for _ in range(rng.randint(1, 12))]
    else:
        fields["prompt"] = rng.choice(["Hello", "The cat sat on", "1 2 3 4", "héllo wörld ✓", "x" * 40])
    if rng.random() < 0.5:
        fields.update(temperature=rng.choice([0.0, 0.5, 1.0, 2.0]), top_p=rng.choice([1.0, 0.9, 0.01]),
                      top_k=rng.choice([0, 1, 40, m.U32_MAX >> 8]), min_p=rng.choice([0.0, 0.1, 0.99]),
                      seed=rng.choice([None, 0, 2**63 - 1, rng.getrandbits(32)]))
    if rng.random() < 0.3:
        fields["stop"] = rng.sample(["\n", ".", "the", "ab", "é"], rng.randint(1, 3))
    if rng.random() < 0.3:
        fields["speculate"] = rng.random() < 0.5
    if rng.random() < 0.25:
        fields["logprobs"] = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.15:
        fields["prompt_logprobs"] = rng.choice([0, 1, 20])
    if rng.random() < 0.2:
        fields.update(presence_penalty=rng.choice([0.0, -2.0, 0.5, 2.0]),
                      frequency_penalty=rng.choice([0.0, 1.5, -0.3]), repetition_penalty=rng.choice([1.0, 1.3, 0.5, 10]))
    if rng.random() < 0.15:  # ids below every model's vocabulary, JSON keys as text
        fields["logit_bias"] = {str(rng.randrange(1000)): rng.choice([-100, -2.5, 3, 100])
                                for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.15:  # vLLM's extras: end tokens held back, added, or EOS ignored
        fields.update(min_tokens=rng.randint(0, fields["max_tokens"]), ignore_eos=rng.random() < 0.5,
                      stop_token_ids=[rng.randrange(1000) for _ in range(rng.randint(0, 3))])
    return fields


def _json(tag: bytes, obj) -> list[bytes]:
    return [tag, json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")]


def weird_value(rng: random.Random):
    return rng.choice([
        None, True, False, 0, -1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, -0.0, 1e308,
        "", "7", "\x00", "\ud800", "é" * 50, [], [1], [[1]], {}, {"a": 1}, [None], ["x"], [1.5], [-1],
    ])


def valid_generate(rng):
    return FuzzFrame("valid_generate", _json(m.Generate.TAG, _valid_fields(rng)), True)


def valid_stats(rng):
    return FuzzFrame("valid_stats", _json(m.StatsRequest.TAG, {"ref": _ref(rng)}), True)


def valid_tokenize(rng):
    if rng.random() < 0.5:
        fields = {"ref": _ref(rng), "prompt": rng.choice(["Hello", "héllo wörld ✓", "x" * 40, "\n\t "])}
        return FuzzFrame("valid_tokenize", _json(m.Tokenize.TAG, fields), True)
    token_ids = [rng.randrange(VOCAB_SIZE_GUESS) for _ in range(rng.randint(0, 40))]
    return FuzzFrame("valid_tokenize", _json(m.Detokenize.TAG, {"ref": _ref(rng), "token_ids": token_ids}), True)


def bad_tokenize(rng):
    fields = rng.choice([{}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, {"prompt": 5},
                         {"prompt": "\ud800"}, {"token_ids": [1, -1]}, {"token_ids": [2**32]},
                         {"token_ids": [300_000]}, {"token_ids": "abc"}, {"prompt": "a", "extra": 1}])
    tag = m.Detokenize.TAG if "token_ids" in fields else m.Tokenize.TAG
    return FuzzFrame("bad_tokenize", _json(tag, {"ref": _ref(rng), **fields}), False)


def cancel_unknown(rng):
    request_id = rng.choice([f"r{rng.randint(0, 10**6)}", "", "x" * 300, _ref(rng)])
    return FuzzFrame("cancel_unknown", _json(m.Cancel.TAG, {"request_id": request_id}), False)


_OUT_OF_RANGE = {"max_tokens": [0, -1, (1 << 20) + 1, 2**32, 2**32 + 1, 2**64, 10**40],
                 "top_k": [-1, (1 << 24) + 1, 2**32, 2**64, -(2**63)],
                 "seed": [-1, 2**63, 2**64, 10**40],
                 "logprobs": [-1, 21, 2**32, 2**64],
                 "prompt_logprobs": [-1, 21, 2**64],
                 "min_tokens": [-1, (1 << 20) + 1, 2**64],
                 "token_ids": [-1, 300_000, 2**32, 2**63, 10**40]}


def int_out_of_range(rng):
    fields = _valid_fields(rng)
    name = rng.choice(list(_OUT_OF_RANGE))
    value = rng.choice(_OUT_OF_RANGE[name])
    if name == "token_ids":
        fields.pop("prompt", None)
        fields["token_ids"] = [1, value, 2]
    else:
        fields[name] = value
    return FuzzFrame("int_out_of_range", _json(m.Generate.TAG, fields), False)


def wrong_type(rng):
    fields = _valid_fields(rng)
    fields[rng.choice(ALL_FIELDS)] = weird_value(rng)
    return FuzzFrame("wrong_type", _json(m.Generate.TAG, fields), False)


def float_edge(rng):
    fields = _valid_fields(rng)
    fields[rng.choice(["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                       "repetition_penalty"])] = rng.choice(
        [-1e-300, 1e300, -0.0, 1.0000001, 5e-324, 1e999, -1e999])
    body = json.dumps(fields).replace("Infinity", "1e999").encode()
    return FuzzFrame("float_edge", [m.Generate.TAG, body], False)


def unknown_field(rng):
    fields = _valid_fields(rng)
    fields[rng.choice(["max_tokenz", "Ref", "", "prompt ", "\u00e9", "stream"])] = weird_value(rng)
    return FuzzFrame("unknown_field", _json(m.Generate.TAG, fields), False)


def missing_ref(rng):
    fields = _valid_fields(rng)
    del fields["ref"]
    return FuzzFrame("missing_ref", _json(rng.choice([m.Generate.TAG, m.StatsRequest.TAG]), fields), False)


def prompt_and_ids(rng):
    fields = _valid_fields(rng)
    if rng.random() < 0.5:
        fields.update(prompt="hi", token_ids=[1, 2])
    else:
        fields.pop("prompt", None)
        fields.pop("token_ids", None)
    return FuzzFrame("prompt_and_ids", _json(m.Generate.TAG, fields), False)


def empty_prompt(rng):
    fields = _valid_fields(rng)
    fields.pop("prompt", None)
    fields.pop("token_ids", None)
    fields[rng.choice(["prompt", "token_ids"])] = "" if rng.random() < 0.5 else []
    return FuzzFrame("empty_prompt", _json(m.Generate.TAG, fields), False)


def deep_nesting(rng):
    depth = rng.choice([17, 64, 1000, 20_000, 200_000])
    open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    tag = rng.choice([m.Generate.TAG, m.StatsRequest.TAG, m.Cancel.TAG])
    body = b'{"ref": "deep", "x": ' + open_ * depth + b"1" + close * depth + b"}"
    return FuzzFrame("deep_nesting", [tag, body], False)


def huge_prompt(rng):
    fields = _valid_fields(rng)
    fields.pop("token_ids", None)
    unit = rng.choice(["ab ", "é", "token ", "\n"])  # under the 1 MiB body limit: the prompt limit must refuse it
    fields["prompt"] = unit * (rng.randint(300_000, 1_000_000) // len(unit.encode()))
    return FuzzFrame("huge_prompt", _json(m.Generate.TAG, fields), False)


def long_token_ids(rng):
    fields = _valid_fields(rng)
    fields.pop("prompt", None)
    fields["token_ids"] = [1] * rng.randint(40_000, 120_000)
    return FuzzFrame("long_token_ids", _json(m.Generate.TAG, fields), False)


def oversized_body(rng):
    body = b'{"ref": "fat", "prompt": "' + b"a" * rng.randint(m.MAX_MESSAGE_BYTES, m.MAX_CLIENT_FRAME_BYTES - 64) + b'"}'
    return FuzzFrame("oversized_body", [m.Generate.TAG, body], False)


def stop_abuse(rng):
    fields = _valid_fields(rng)
    fields["stop"] = rng.choice([["x"] * rng.randint(17, 90_000), ["y" * rng.randint(257, 5000)], [""],
                                 ["a", ""], "notalist"])
    return FuzzFrame("stop_abuse", _json(m.Generate.TAG, fields), False)


def long_ref(rng):
    fields = _valid_fields(rng)
    fields = {"ref": "r" * rng.randint(257, 100_000)} if rng.random() < 0.5 else fields | {"ref": "r" * 257}
    return FuzzFrame("long_ref", _json(rng.choice([m.Generate.TAG, m.StatsRequest.TAG]), fields), False)


def bad_json(rng):
    body = rng.choice([b"", b"{", b"[]", b"null", b"1", b'"s"', b"{'ref': 1}", b'{"ref": "a",}', b"\xff\xfe",
                       b'{"ref": "a"}' * 2, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))])
    return FuzzFrame("bad_json", [rng.choice([m.Generate.TAG, m.StatsRequest.TAG, m.Cancel.TAG]), body], False)


def bad_tag(rng):
    tag = rng.choice([b"", b"GG", b"\x00", b"Q", b"g", b"K", b"A", b"E", b"T", b"i", b"h", b"\xff" * 9])
    return FuzzFrame("bad_tag", [tag, json.dumps(_valid_fields(rng)).encode()], False)


def worker_message(rng):
    msg = rng.choice([m.Hello(pid=1, model_path="/x", max_context_tokens=8, vocab_size=8, drafter="none"),
                      m.Taken(worker_id=1, slots=[0, 1]), m.Dead(worker_id=1, message="forged"),
                      m.Round(worker_id=1, round_index=1, emitted_at_ns=0, outputs=[])])
    frames = m.encode_msgpack(msg)
    return FuzzFrame("worker_message", frames if rng.random() < 0.5 else [m.Generate.TAG, frames[1]], False)


def frame_count(rng):
    body = json.dumps(_valid_fields(rng)).encode()
    frames = rng.choice([[m.Generate.TAG], [body], [m.Generate.TAG, body, b""], [b"", b"", b""],
                         [m.Generate.TAG] * 5, [m.Generate.TAG, body, body]])
    return FuzzFrame("frame_count", frames, False)


def mutated_valid(rng):
    body = bytearray(json.dumps(_valid_fields(rng)).encode())
    for _ in range(rng.randint(1, 4)):
        action = rng.randrange(3)
        pos = rng.randrange(len(body))
        if action == 0:
            body[pos] = rng.getrandbits(8)
        elif action == 1:
            del body[pos:pos + rng.randint(1, 8)]
        else:
            body[pos:pos] = rng.choice([b"[", b"{", b'"', b"\\", b"9" * 30, b"-", b"\x00"])
    return FuzzFrame("mutated_valid", [rng.choice([m.Generate.TAG, m.StatsRequest.TAG]), bytes(body)], False)


def msgpack_body(rng):
    body = msgspec.msgpack.encode(_valid_fields(rng))
    return FuzzFrame("msgpack_body", [m.Generate.TAG, body], False)


CLASSES = {f.__name__: f for f in (
    valid_generate, valid_stats, valid_tokenize, bad_tokenize, cancel_unknown, int_out_of_range, wrong_type, float_edge, unknown_field,
    missing_ref, prompt_and_ids, empty_prompt, deep_nesting, huge_prompt, long_token_ids, oversized_body,
    stop_abuse, long_ref, bad_json, bad_tag, worker_message, frame_count, mutated_valid, msgpack_body)}
# Large frames cost the fuzzer more than the server: draw them less often.
WEIGHTS = {name: 0.2 if name in ("huge_prompt", "oversized_body", "long_token_ids") else
           3.0 if name in ("valid_generate", "mutated_valid", "wrong_type") else 1.0 for name in CLASSES}


def draw(rng: random.Random, name: str | None = None) -> FuzzFrame:
    if name is None:
        name = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    return CLASSES[name](rng)


@dataclass(frozen=True)
class Observation:
    outcome: str  # served | stats | answered | error+ref | error | silent | failed_after_accept | hang
    first_reply_s: float | None  # send -> first reply to the fuzzed frame


# Classes the server must refuse every time (the rest may, by chance, draw a valid request).
SERVED = ("served", "stats", "answered")  # the outcomes a valid frame may get: its reply, whole
ALWAYS_REFUSED = frozenset({"bad_tokenize", "int_out_of_range", "unknown_field", "missing_ref", "prompt_and_ids", "empty_prompt",
                            "deep_nesting", "huge_prompt", "long_token_ids", "oversized_body", "stop_abuse",
                            "long_ref", "bad_json", "bad_tag", "worker_message", "frame_count", "msgpack_body"})


class Prober:
    """Sends one fuzzed frame, then a STATS probe; everything before the probe's reply
    answers the frame (the front-end handles one connection's messages in order)."""

    def __init__(self, sock, timeout_s: float = 30.0):
        self._sock = sock
        self._timeout_s = timeout_s
        self._num_probes = 0

    def observe(self, frame: FuzzFrame) -> Observation:
        import time

        self._num_probes += 1
        probe_ref = f"probe-{self._num_probes}"
        start_s = time.perf_counter()
        self._sock.send_multipart(frame.frames)
        self._sock.send_multipart(_json(m.StatsRequest.TAG, {"ref": probe_ref}))
        deadline_s = start_s + self._timeout_s
        first_reply_s, replies, is_probe_answered, is_finished = None, [], False, False
        while not is_probe_answered or (replies and replies[0][0] == b"A" and not is_finished):
            if not self._sock.poll(max(1, int((deadline_s - time.perf_counter()) * 1000))):
                return Observation("hang", first_reply_s)
            tag, body = self._sock.recv_multipart()
            obj = json.loads(body)
            if tag == b"T" and obj.get("ref") == probe_ref:
                is_probe_answered = True
                continue
            if first_reply_s is None:
                first_reply_s = time.perf_counter() - start_s
            replies.append((tag, obj))
            is_finished = tag == b"E" or (tag == b"K" and obj["finish_reason"] is not None)
        return Observation(_classify(replies), first_reply_s)


def _classify(replies: list[tuple[bytes, dict]]) -> str:
    if not replies:
        return "silent"
    tag, obj = replies[0]
    if tag == b"T":
        return "stats"
    if tag in (m.Tokens.TAG, m.Text.TAG):
        return "answered"
    if tag == b"E":
        return "error+ref" if obj.get("ref") is not None else "error"
    assert tag == b"A", (tag, obj)
    last_tag, last = replies[-1]
    if last_tag == b"K" and last["finish_reason"] in ("length", "stop"):
        chunks = [o for t, o in replies if t == b"K"]
        if [o["seq"] for o in chunks] != list(range(len(chunks))):
            return "gap"
        # A request that asked for logprobs gets one entry per token in every chunk; others get no
        # field. Prompt logprobs come in the first chunk alone, led by an entry without a logprob.
        has_logprobs = {o.get("logprobs") is not None for o in chunks}
        is_aligned = all(len(o["logprobs"]) == len(o["token_ids"]) for o in chunks if o.get("logprobs") is not None)
        prompt = chunks[0].get("prompt_logprobs")
        is_prompt_ok = (not any(o.get("prompt_logprobs") is not None for o in chunks[1:])
                        and (prompt is None or (prompt and prompt[0]["logprob"] is None)))
        return "served" if len(has_logprobs) == 1 and is_aligned and is_prompt_ok else "bad_logprobs"
    return "failed_after_accept"
