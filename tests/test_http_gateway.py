"""The OpenAI-compatible HTTP gateway end to end: a real `gmlx serve --http-port` process with
its gateway on loopback, the official `openai` package as the client, the built-in model.

HTTP answers are checked against the same server's ZeroMQ answers (which test_serving_e2e
checks against solo in-process decoding)."""

import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import http_cases
from ipc.client import Client
from serving_support import REPO_ROOT, Server, free_port, make_chat_model_dir, repo_env

TEST_TIMEOUT_S = 150  # hard: a hung socket must fail the run, not stall it
MODEL_ID = "builtin-chat"
PROMPT = "def parse_args(argv):"



@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    return make_chat_model_dir(tmp_path_factory.mktemp("models") / MODEL_ID)


@pytest.fixture(scope="module")
def server(chat_model_dir):
    port = free_port()
    srv = Server("--http-port", str(port), model=chat_model_dir, drafter="ngram")
    srv.wait_for_line("http ready")
    srv.http_url = f"http://127.0.0.1:{port}"
    yield srv
    code = srv.terminate()
    assert code == 0, srv.log()


@pytest.fixture
def oai(server):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=60, max_retries=0)
    yield client
    client.close()


def zmq_text(server, **kwargs) -> tuple[str, str]:
    with Client(server.address, timeout_s=60) as client:
        chunks = list(client.generate(**kwargs))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def http_post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def http_get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(server) -> dict:
    """name -> list of (labels, value) from /metrics, parsed by prometheus_client's parser."""
    status, body = http_get(server.http_url + "/metrics")
    assert status == 200, body
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def test_health_and_models(server, oai):
    status, body = http_get(server.http_url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert [model.id for model in oai.models.list()] == [MODEL_ID]
    assert oai.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("another-model")
    assert http_get(server.http_url + "/v1/nothing-here")[0] == 404


def test_completion_equals_zmq_stream_or_not(server, oai):
    want_text, _ = zmq_text(server, prompt=PROMPT, max_tokens=24)
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0)
    assert done.choices[0].text == want_text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens > 0
    events = list(oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert len(events) > 1
    assert "".join(e.choices[0].text for e in events) == want_text
    assert [e.choices[0].finish_reason for e in events] == [None] * (len(events) - 1) + ["length"]
    assert events[-1].usage.completion_tokens == 24
    # Seeded sampling: the same tokens over either link.
    want_text, _ = zmq_text(server, prompt=PROMPT, max_tokens=16, temperature=0.8, top_k=20, seed=7)
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=7,
                                  extra_body={"top_k": 20, "speculate": True})
    assert done.choices[0].text == want_text


def test_speculate_false_drafts_nothing_and_keeps_the_tokens(server, oai):
    """The server's n-gram drafter drafts on a repeating prompt; `speculate: false` over HTTP
    pins that request to plain decoding (no drafts in the worker's counters), same text."""
    prompt = "alpha beta gamma delta " * 16

    def drafted_by(speculate: bool) -> tuple[int, str]:
        with Client(server.address, timeout_s=30) as zmq_client:
            before = zmq_client.stats()["num_drafted"]
            done = oai.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=32, temperature=0,
                                          extra_body={"speculate": speculate})
            return zmq_client.stats()["num_drafted"] - before, done.choices[0].text

    num_pinned, pinned_text = drafted_by(False)
    num_free, free_text = drafted_by(True)
    assert num_pinned == 0 and num_free > 0, (num_pinned, num_free)
    assert pinned_text == free_text


def zmq_logprobs(server, **kwargs) -> tuple[list[int], list[dict]]:
    with Client(server.address, timeout_s=60) as client:
        chunks = list(client.generate(**kwargs))
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in chunks)
    return [t for c in chunks for t in c.token_ids], [e for c in chunks for e in c.logprobs]


def test_logprobs_over_zmq_and_http_agree_and_do_not_depend_on_speculation(server, oai):
    """Each token's logprob and its 3 likeliest, over ZeroMQ with speculation on and off (the
    same bits: the engine's invariant), and over HTTP in both flavours, streamed or not."""
    kwargs = dict(prompt=PROMPT * 3, max_tokens=20, temperature=0.8, seed=11, logprobs=3)
    token_ids, entries = zmq_logprobs(server, **kwargs)
    assert zmq_logprobs(server, **kwargs, speculate=False) == (token_ids, entries)
    assert [e["token_id"] for e in entries] == token_ids and len(entries) == 20
    for e in entries:
        top = [t["logprob"] for t in e["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True) and e["logprob"] <= 0
        listed = {t["token_id"]: t["logprob"] for t in e["top_logprobs"]}
        assert listed.get(e["token_id"], e["logprob"]) == e["logprob"]
        assert e["token_id"] in listed or e["logprob"] <= top[-1]
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT * 3, max_tokens=20, temperature=0.8, seed=11,
                                  logprobs=3)
    lp = done.choices[0].logprobs
    assert lp.tokens == [e["token"] for e in entries] and lp.token_logprobs == [e["logprob"] for e in entries]
    assert lp.top_logprobs == [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == sum(len(e["token"]) for e in entries[:-1])
    events = list(oai.completions.create(model=MODEL_ID, prompt=PROMPT * 3, max_tokens=20, temperature=0.8,
                                         seed=11, logprobs=3, stream=True))
    streamed = [e.choices[0].logprobs for e in events]
    assert [t for s in streamed for t in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4).choices[0].logprobs is None
    chat_turns = [{"role": "user", "content": PROMPT}]
    want_ids, want = zmq_logprobs(server, messages=chat_turns, max_tokens=12, logprobs=2)
    done = oai.chat.completions.create(model=MODEL_ID, messages=chat_turns, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(e["token"], e["logprob"]) for e in want]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
        [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in want]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    events = list(oai.chat.completions.create(model=MODEL_ID, messages=chat_turns, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True))
    streamed = [c.logprob for e in events if e.choices[0].logprobs for c in e.choices[0].logprobs.content]
    assert streamed == [e["logprob"] for e in want]


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(server, oai):
    """lm-eval's loglikelihood request: echo, logprobs 1, one new token, greedy. The answer holds
    the prompt then the new token, each token's logprob (the first prompt token's null) as the
    server's ZeroMQ prompt_logprobs / logprobs give them, streamed or not."""
    prompt = PROMPT + " return"
    with Client(server.address, timeout_s=60) as client:
        chunks = list(client.generate(prompt=prompt, max_tokens=1, logprobs=1, prompt_logprobs=1))
    prompt_entries = chunks[0].prompt_logprobs
    assert prompt_entries[0]["logprob"] is None and all(e["logprob"] < 0 for e in prompt_entries[1:])
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    want = prompt_entries + [e for c in chunks for e in c.logprobs]
    body = dict(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    done = oai.completions.create(**body)
    lp = done.choices[0].logprobs
    assert done.choices[0].text == prompt + "".join(c.text for c in chunks)
    assert lp.tokens == [e["token"] for e in want] and lp.token_logprobs == [e["logprob"] for e in want]
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    events = list(oai.completions.create(**body, stream=True))
    assert "".join(e.choices[0].text for e in events) == done.choices[0].text
    assert [t for e in events if e.choices[0].logprobs for t in e.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    # lm-eval's local-completions payload as it sends it (a batch of one token-id prompt) and its
    # reading of the answer: the continuation's summed logprob and whether it is the greedy one.
    token_ids = [e["token_id"] for e in prompt_entries]
    status, answer = http_post(server.http_url + "/v1/completions", {
        "model": MODEL_ID, "prompt": [token_ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True})
    assert status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    context_len = 3
    continuation = lp["token_logprobs"][context_len:-1]
    assert continuation == [e["logprob"] for e in prompt_entries[context_len:]]
    is_greedy = all(t == max(top.values()) for t, top in zip(continuation, lp["top_logprobs"][context_len:-1]))
    assert is_greedy == all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in prompt_entries[context_len:])
    # A token-id prompt echoes as its tokens' own texts, without logprobs where none were asked.
    done = oai.completions.create(model=MODEL_ID, prompt=token_ids, max_tokens=1, temperature=0, echo=True)
    assert done.choices[0].text.startswith("".join(e["token"] for e in prompt_entries))
    assert done.choices[0].logprobs is None


def test_a_batch_of_prompts_and_n_samples_are_each_the_zmq_answer_of_their_seed(server, oai):
    """prompt as a list and n: a choice per (prompt, sample), index prompt by prompt; sample j of a
    seeded request is the ZeroMQ answer with seed + j, streamed or not; usage counts each prompt once."""
    prompts = [PROMPT, "class Parser:"]
    want = [zmq_text(server, prompt=p, max_tokens=10, temperature=0.8, seed=7 + j)[0]
            for p in prompts for j in range(2)]
    assert len(set(want)) > 1  # the samples differ, so the order is checked
    done = oai.completions.create(model=MODEL_ID, prompt=prompts, n=2, max_tokens=10, temperature=0.8, seed=7)
    assert [c.index for c in done.choices] == [0, 1, 2, 3] and [c.text for c in done.choices] == want
    assert done.usage.completion_tokens == 40
    with Client(server.address, timeout_s=60) as client:
        prompt_tokens = sum(list(client.generate(prompt=p, max_tokens=1))[-1].stats["prompt_tokens"] for p in prompts)
    assert done.usage.prompt_tokens == prompt_tokens
    events = list(oai.completions.create(model=MODEL_ID, prompt=prompts, n=2, max_tokens=10, temperature=0.8, seed=7,
                                         stream=True, stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    for event in events:
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == want and events[-1].usage.completion_tokens == 40
    assert sorted(c.finish_reason for e in events for c in e.choices if c.finish_reason) == ["length"] * 4
    turns = [{"role": "user", "content": PROMPT}]
    want = [zmq_text(server, messages=turns, max_tokens=8, temperature=0.8, seed=3 + j)[0] for j in range(3)]
    done = oai.chat.completions.create(model=MODEL_ID, messages=turns, n=3, max_tokens=8, temperature=0.8, seed=3)
    assert [c.message.content for c in done.choices] == want


def test_repeat_penalties_over_http_are_the_zmq_answers(server, oai):
    """presence_penalty and frequency_penalty (refused until session 48) reach the engine as over
    ZeroMQ; a value outside OpenAI's [-2, 2] is a 400 naming it."""
    prompt = "x = [1, 1, 1, 1"
    plain = zmq_text(server, prompt=prompt, max_tokens=16)[0]
    want = zmq_text(server, prompt=prompt, max_tokens=16, presence_penalty=2.0, frequency_penalty=1.0)[0]
    assert want != plain  # the penalties change this greedy answer
    done = oai.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=2.0,
                                  frequency_penalty=1.0)
    assert done.choices[0].text == want
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_ID, prompt=prompt, frequency_penalty=2.5)
    assert info.value.body["param"] == "frequency_penalty"
    # vLLM's repetition_penalty (session 49), an extra: the prompt's tokens count too
    want = zmq_text(server, prompt=prompt, max_tokens=16, repetition_penalty=1.5)[0]
    assert want != plain
    done = oai.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    assert done.choices[0].text == want
    status, reply = http_post(server.http_url + "/v1/completions", {"model": MODEL_ID, "prompt": prompt,
                                                                    "repetition_penalty": 0})
    assert status == 400 and reply["error"]["param"] == "repetition_penalty"


def test_logit_bias_over_http_is_the_zmq_answer(server, oai):
    """logit_bias (refused until session 49) reaches the engine as over ZeroMQ, on both endpoints;
    a key that is not a token id, an id outside the vocabulary or a value outside [-100, 100] is a
    400 naming it."""
    with Client(server.address, timeout_s=60) as client:
        first = list(client.generate(PROMPT, max_tokens=8))[0].token_ids[0]
    want = zmq_text(server, prompt=PROMPT, max_tokens=8, logit_bias={first: -100, 5: 2.5})[0]
    assert want != zmq_text(server, prompt=PROMPT, max_tokens=8)[0]
    bias = {str(first): -100, "5": 2.5}
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=bias)
    assert done.choices[0].text == want
    turns = [{"role": "user", "content": PROMPT}]
    want_chat = zmq_text(server, messages=turns, max_tokens=8, logit_bias={first: -100, 5: 2.5})[0]
    chat = oai.chat.completions.create(model=MODEL_ID, messages=turns, max_tokens=8, temperature=0, logit_bias=bias)
    assert chat.choices[0].message.content == want_chat
    for bad in ({"x": 1}, {"-3": 1}, {"5": "1"}, {str(10**6): 1}, {"5": 101}, {str(i): 1 for i in range(301)}):
        status, reply = http_post(server.http_url + "/v1/completions",
                                  {"model": MODEL_ID, "prompt": PROMPT, "logit_bias": bad})
        assert status == 400 and reply["error"]["param"] == "logit_bias", (bad, reply)


def test_best_of_answers_the_samples_with_the_highest_logprob_per_token(server, oai):
    """best_of 4, n 2 (refused until session 49): sample j is the seed + j request over ZeroMQ, and
    the answer holds the two with the highest mean token logprob, best first; usage counts all four."""
    samples = []
    with Client(server.address, timeout_s=60) as client:
        for j in range(4):
            chunks = list(client.generate(PROMPT, max_tokens=6, temperature=1.0, seed=11 + j, logprobs=0))
            entries = [e for c in chunks for e in c.logprobs]
            samples.append((sum(e["logprob"] for e in entries) / len(entries), "".join(c.text for c in chunks)))
    want = [text for _, text in sorted(samples, key=lambda s: -s[0])[:2]]
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=2,
                                  best_of=4)
    assert [c.text for c in done.choices] == want and [c.index for c in done.choices] == [0, 1]
    assert all(c.logprobs is None for c in done.choices) and done.usage.completion_tokens == 24
    with_logprobs = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
                                           best_of=4, logprobs=1)
    assert with_logprobs.choices[0].text == want[0] and len(with_logprobs.choices[0].logprobs.tokens) == 6
    for body in ({"best_of": 3, "stream": True}, {"best_of": 1, "n": 2}):
        status, reply = http_post(server.http_url + "/v1/completions", {"model": MODEL_ID, "prompt": PROMPT, **body})
        assert status == 400 and reply["error"]["param"] == "best_of", (body, reply)


def test_vllm_end_token_extras_over_http_are_the_zmq_answers(server, oai):
    """ignore_eos, min_tokens and stop_token_ids (vLLM's extras, which serving benchmarks send)
    reach the engine as over ZeroMQ; bad ones are a 400 naming them."""
    with Client(server.address, timeout_s=60) as client:
        plain = [t for c in client.generate(PROMPT, max_tokens=12) for t in c.token_ids]
    extras = [dict(stop_token_ids=[plain[4]]), dict(stop_token_ids=[plain[4]], min_tokens=6),
              dict(logit_bias={0: 100}, ignore_eos=True), dict(logit_bias={0: 100}, min_tokens=3)]
    for extra in extras:
        want = zmq_text(server, prompt=PROMPT, max_tokens=12, **extra)
        body = {**extra, "logit_bias": {str(k): v for k, v in extra.get("logit_bias", {}).items()}}
        done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=body)
        assert (done.choices[0].text, done.choices[0].finish_reason) == want, extra
    for bad, param in (({"min_tokens": 13}, "min_tokens"), ({"min_tokens": "2"}, "min_tokens"),
                       ({"ignore_eos": 1}, "ignore_eos"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
                       ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [1] * 65}, "stop_token_ids")):
        status, reply = http_post(server.http_url + "/v1/completions",
                                  {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 12, **bad})
        assert status == 400 and reply["error"]["param"] == param, (bad, reply)


def test_tokenize_and_detokenize_answer_as_the_zmq_client(server):
    """vLLM's /tokenize and /detokenize (session 49): the ids and text the ZeroMQ client gets; a
    chat is rendered as a chat completion renders it; bad bodies are 400s naming the field."""
    turns = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    with Client(server.address, timeout_s=60) as client:
        want_ids = client.tokenize(PROMPT)
        want_chat = client.tokenize(messages=[{"role": "user", "content": PROMPT}])
        want_text = client.detokenize(want_chat)
    status, reply = http_post(server.http_url + "/tokenize", {"model": MODEL_ID, "prompt": PROMPT})
    assert status == 200 and reply["tokens"] == want_ids and reply["count"] == len(want_ids)
    assert reply["max_model_len"] > len(want_ids)
    status, reply = http_post(server.http_url + "/tokenize", {"messages": turns})
    assert status == 200 and reply["tokens"] == want_chat
    status, reply = http_post(server.http_url + "/detokenize", {"model": MODEL_ID, "tokens": want_chat})
    assert status == 200 and reply == {"prompt": want_text}
    bad = [("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {}, 400, "prompt"),
           ("/tokenize", {"prompt": "a", "messages": turns}, 400, "prompt"),
           ("/tokenize", {"messages": []}, 400, "messages"), ("/tokenize", {"model": "x", "prompt": "a"}, 404, "model"),
           ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"), ("/detokenize", {"tokens": [10**6]}, 400, "token_ids")]
    for path, body, want_status, param in bad:
        status, reply = http_post(server.http_url + path, body)
        assert (status, reply["error"]["param"]) == (want_status, param), (path, body, reply)


def test_raw_stream_ends_with_done(server):
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(server.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage_only = json.loads(events[-2][len("data: "):])
    assert usage_only["choices"] == [] and usage_only["usage"]["completion_tokens"] == 8


def test_chat_equals_zmq_stream_or_not(server, oai, chat_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_text, _ = zmq_text(server, token_ids=tokenizer.encode(text, add_special_tokens=False), max_tokens=20)
    done = oai.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == want_text
    assert done.usage.completion_tokens == 20
    events = list(oai.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0,
                                              stream=True))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == want_text
    assert events[-1].choices[0].finish_reason == "length" and events[-1].usage.total_tokens > 20


def test_stop_string(server, oai):
    full = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    done = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert done.choices[0].text == full[:full.index(stop)]
    assert done.choices[0].finish_reason == "stop"
    events = list(oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(e.choices[0].text for e in events) == full[:full.index(stop)]
    assert events[-1].choices[0].finish_reason == "stop"


def test_closing_the_stream_cancels_on_the_server(server, oai):
    with Client(server.address, timeout_s=30) as zmq_client:
        num_cancelled = zmq_client.stats()["num_cancelled"]
        stream = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=900, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()  # drops the connection mid-stream
        deadline_s = time.monotonic() + 20
        while ((stats := zmq_client.stats())["num_cancelled"] == num_cancelled or stats["num_frontend_requests"]
               or stats["num_active"]):
            assert time.monotonic() < deadline_s, stats
            time.sleep(0.05)
        assert stats["num_cancelled"] == num_cancelled + 1


def test_bad_parameters_get_openai_errors(server, oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_ID, prompt=PROMPT, top_p=5)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "top_p" and info.value.body["type"] == "invalid_request_error"
    assert "top_p" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_ID, prompt=PROMPT, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:  # checked by the front-end, named there
        oai.completions.create(model=MODEL_ID, prompt=PROMPT, extra_body={"min_p": 1.5})
    assert info.value.body["param"] == "min_p"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL_ID, messages=[], stream=True)
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-model", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as info:  # the ZeroMQ side's 1 MiB message limit
        oai.completions.create(model=MODEL_ID, prompt="x" * (1 << 20))
    assert info.value.status_code == 413 and "bytes" in info.value.body["message"]


def test_metrics_count_what_clients_saw(server):
    before = scrape(server)
    jobs = [dict(max_tokens=8 + 4 * i, stream=i % 2 == 0) for i in range(6)]
    jobs[1]["stop"] = ["\n"]
    seen = {"finish": [], "tokens": 0, "mid_scrape": None}
    lock = threading.Lock()

    def run(job: dict) -> None:
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=60, max_retries=0) as c:
            if job["stream"]:
                events = list(c.completions.create(model=MODEL_ID, prompt=PROMPT, temperature=0, stream=True,
                                                   **{k: v for k, v in job.items() if k != "stream"}))
                finish, usage = events[-1].choices[0].finish_reason, events[-1].usage
            else:
                done = c.completions.create(model=MODEL_ID, prompt=PROMPT, temperature=0,
                                            **{k: v for k, v in job.items() if k != "stream"})
                finish, usage = done.choices[0].finish_reason, done.usage
        with lock:
            seen["finish"].append(finish)
            seen["tokens"] += usage.completion_tokens

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    seen["mid_scrape"] = scrape(server)  # during the load: must parse, gauges present
    for t in threads:
        t.join(60)
    assert len(seen["finish"]) == len(jobs)
    after = scrape(server)
    assert "gmlx_http_requests_in_flight" in seen["mid_scrape"]
    assert value(after, "gmlx_http_requests_in_flight") == 0
    for reason in ("stop", "length"):
        delta = (value(after, "gmlx_http_requests_total", endpoint="completions", finish_reason=reason)
                 - value(before, "gmlx_http_requests_total", endpoint="completions", finish_reason=reason))
        assert delta == seen["finish"].count(reason), reason
    assert value(after, "gmlx_http_generation_tokens_total") - value(before, "gmlx_http_generation_tokens_total") \
        == seen["tokens"]
    assert value(after, "gmlx_http_time_to_first_token_seconds_count") \
        - value(before, "gmlx_http_time_to_first_token_seconds_count") == len(jobs)
    assert value(after, "gmlx_engine_requests_total") - value(before, "gmlx_engine_requests_total") == len(jobs)
    assert value(after, "gmlx_engine_rounds_total") > value(before, "gmlx_engine_rounds_total")
    assert value(after, "gmlx_workers") == 1
    for name in ("gmlx_carried_over_requests_total", "gmlx_worker_restarts_total"):  # no worker died here
        assert after[name] == [({}, 0.0)], (name, after.get(name))
    assert {lab["loop"] for lab, _ in after["gmlx_engine_rounds_total"]} >= {"scalar", "batch", "gated", "capture"}


def run_gateway(*args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workers.http_gateway", *args]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env={**repo_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_listening(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered (401 and all)
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline_s, proc.communicate()
            time.sleep(0.1)


def test_bearer_token_and_unreachable_server(server, tmp_path):
    # Off loopback without a token: refused before binding, naming the option to use.
    proc = run_gateway("--server", server.address, "--http", "http://0.0.0.0:1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--http-api-key-file" in err
    # A token from a file: required on every /v1 route; a front-end that never answers is a 503.
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    url = f"http://127.0.0.1:{free_port()}"
    dead_address = f"tcp://127.0.0.1:{free_port()}"
    proc = run_gateway("--server", dead_address, "--http", url, "--http-api-key-file", str(key_file),
                       "--timeout-s", "1")
    try:
        wait_listening(url, proc)
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=30) as c:
            assert [m.id for m in c.models.list()] == ["gmlx-builtin"]
            with pytest.raises(openai.APIStatusError) as info:
                c.completions.create(model="gmlx-builtin", prompt=PROMPT, max_tokens=4)
        assert info.value.status_code == 503 and info.value.body["type"] == "server_unavailable"
        assert http_get(url + "/health")[0] == 503
        assert http_get(url + "/metrics")[0] == 401
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_serve_refuses_an_open_http_address_without_a_token():
    cmd = [sys.executable, "-m", "workers.cli_serve", "--workers", "0", "--http", "http://0.0.0.0:8000"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--http-api-key-file" in done.stderr, done.stderr


def check_http_cases(server, cases: list) -> None:
    """Every case served (a complete 200 answer) or refused (4xx, OpenAI's error body); the same
    gateway process throughout, and a valid request served after them."""
    port, pid = int(server.http_url.rsplit(":", 1)[1]), server.gateway_pid()
    for case in cases:
        reply = http_cases.send("127.0.0.1", port, case)
        assert http_cases.problem(case, reply) is None, (case.name, case.path, (case.body or b"")[:200], reply)
    valid = http_cases.draw(random.Random(0), MODEL_ID, "valid_completion")
    assert http_cases.problem(valid, http_cases.send("127.0.0.1", port, valid)) is None
    assert server.gateway_pid() == pid and server.proc.poll() is None, server.log()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(draws=st.lists(st.tuples(st.sampled_from(sorted(http_cases.CLASSES)), st.integers(0, 2**32)),
                      min_size=1, max_size=6))
def test_hostile_http_requests_are_refused_and_the_gateway_keeps_serving(server, draws):
    check_http_cases(server, [http_cases.draw(random.Random(seed), MODEL_ID, name) for name, seed in draws])


def test_every_http_case_class_three_times(server):
    rng = random.Random(3)
    check_http_cases(server, [http_cases.draw(rng, MODEL_ID, name) for name in http_cases.CLASSES for _ in range(3)])


def test_a_lone_surrogate_is_refused_naming_its_field(server):
    """JSON's escapes can spell text UTF-8 cannot carry: a 400 naming the field (it was a 500)."""
    port = int(server.http_url.rsplit(":", 1)[1])
    for path, body, param in (
            ("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
            ("/v1/completions", {"prompt": "a", "stop": ["\udfff"]}, "stop"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages")):
        raw = json.dumps({"model": MODEL_ID, "max_tokens": 2, **body}).encode()  # ASCII: the surrogate escaped
        reply = http_cases.send("127.0.0.1", port, http_cases.HttpCase("surrogate", "POST", path, raw))
        assert reply.status == 400 and json.loads(reply.body)["error"]["param"] == param, reply
    with Client(server.address, timeout_s=30) as zmq_client, pytest.raises(ValueError, match="^prompt: not valid"):
        next(zmq_client.generate(prompt="\ud800", max_tokens=2))


def test_a_killed_gateway_is_restarted(server, oai):
    import psutil

    gateway = psutil.Process(server.gateway_pid())
    gateway.kill()
    gateway.wait(10)
    deadline_s = time.monotonic() + 60
    while http_get_or_none(server.http_url + "/health") != 200:
        assert time.monotonic() < deadline_s, server.log()
        time.sleep(0.2)
    want_text, _ = zmq_text(server, prompt=PROMPT, max_tokens=8)
    assert oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text \
        == want_text
    assert "restarting it" in server.log()


def http_get_or_none(url: str) -> int | None:
    try:
        return http_get(url)[0]
    except OSError:
        return None


# --- request parsing and event shapes, without a server -----------------------------------


def test_parse_completion_fields_and_refusals():
    from workers import http_openai as o

    args = o.parse_completion({"model": "m", "prompt": ["hi"], "stop": "\n", "seed": 3, "top_k": 5, "min_p": 0.1,
                               "stream": True, "stream_options": {"include_usage": True}, "user": "ignored"})
    assert (args.prompt, args.token_ids, args.stop, args.seed, args.top_k, args.min_p) == ("hi", None, ("\n",), 3, 5, 0.1)
    assert args.is_stream and args.is_usage_chunk and args.max_tokens == 16 and args.temperature == 1.0
    assert o.parse_completion({"model": "m", "prompt": [1, 2, 3]}).token_ids == (1, 2, 3)
    assert args.num_logprobs is None and args.client_kwargs()["logprobs"] is None
    assert o.parse_completion({"model": "m", "prompt": "a", "logprobs": 0}).client_kwargs()["logprobs"] == 0
    # echo scores the prompt where logprobs are asked, or where only its tokens' texts can spell it
    echoes = [({"prompt": "a", "echo": True}, None), ({"prompt": "a", "echo": True, "logprobs": 2}, 2),
              ({"prompt": [1, 2], "echo": True}, 0), ({"prompt": [1, 2], "echo": False, "logprobs": 2}, None)]
    for extra, want in echoes:
        assert o.parse_completion({"model": "m", **extra}).client_kwargs()["prompt_logprobs"] == want, extra
    # A batch of prompts and n samples each: one request per choice, prompt by prompt, seed + j.
    batch = o.parse_completion({"model": "m", "prompt": ["a", [7, 8]], "n": 2, "seed": 5}).choices()
    assert [(c.prompt, c.token_ids, c.seed) for c in batch] == [("a", None, 5), ("a", None, 6),
                                                                  (None, (7, 8), 5), (None, (7, 8), 6)]
    assert [c.seed for c in o.parse_completion({"model": "m", "prompt": "a", "n": 3}).choices()] == [None] * 3
    plain = o.parse_completion({"model": "m", "prompt": "a", "speculate": False})
    assert plain.client_kwargs()["speculate"] is False and args.client_kwargs()["speculate"] is True
    bad = [({"model": "m", "prompt": ["a", 5]}, "prompt"), ({"model": "m", "prompt": "a", "n": 17}, "n"),
           ({"model": "m", "prompt": ["a"] * 5, "n": 4}, "n"), ({"model": "m", "prompt": "a", "n": 0}, "n"),
           ({"model": "m", "prompt": [[1], []]}, "prompt"), ({"model": "m", "prompt": "a", "n": 2.0}, "n"),
           ({"model": "m", "prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a"}, "model"),
           ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
           ({"model": "m", "prompt": "a", "echo": 1}, "echo"),
           ({"model": "m", "prompt": "a", "max_tokens": "9"}, "max_tokens"),
           ({"model": "m", "prompt": "a", "stop": ["", "x"]}, "stop"),
           ({"model": "m", "prompt": "a", "speculate": "yes"}, "speculate"),
           ({"model": "m", "prompt": "a", "stream_options": {"include_usage": "yes"}}, "include_usage"),
           ({"model": "m", "prompt": "a", "temperature": True}, "temperature"),
           ({"model": "m", "prompt": "a", "best_of": 0}, "best_of"),
           ({"model": "m", "prompt": ["a"] * 3, "best_of": 6}, "best_of"),
           ({"model": "m", "prompt": "a", "logit_bias": [1]}, "logit_bias"),
           ({"model": "m", "prompt": "a", "logit_bias": {"1.5": 1}}, "logit_bias"),
           ({"model": "m", "prompt": "a", "logit_bias": {"12345678901": 1}}, "logit_bias"),
           ({"model": "m", "prompt": "a", "logit_bias": {"1": None}}, "logit_bias")]
    for body, param in bad:
        with pytest.raises(o.BadRequest) as info:
            o.parse_completion(body)
        assert info.value.param == param and info.value.status == 400, body


def test_parse_chat_joins_text_parts_into_the_messages_it_forwards():
    from workers import http_openai as o

    args = o.parse_chat({"model": "m", "max_completion_tokens": 7, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        default_max_tokens=100)
    assert args.messages == (("user", "ab"),) and args.prompt is None and args.token_ids is None
    assert args.max_tokens == 7
    kwargs = args.client_kwargs()
    assert kwargs["messages"] == [{"role": "user", "content": "ab"}] and kwargs["prompt"] is None
    with pytest.raises(o.BadRequest) as info:
        o.parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                     default_max_tokens=100)
    assert info.value.param == "messages"


def test_parse_chat_logprobs_is_a_switch_and_top_logprobs_its_count():
    from workers import http_openai as o

    turn = [{"role": "user", "content": "a"}]
    cases = [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
             ({"logprobs": True, "top_logprobs": 20}, 20)]
    for extra, want in cases:
        assert o.parse_chat({"model": "m", "messages": turn, **extra}, 9).num_logprobs == want, extra
    bad = [({"logprobs": 3}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"), ({"echo": True}, "echo"),
           ({"best_of": 2}, "best_of"),
           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")]
    for extra, param in bad:
        with pytest.raises(o.BadRequest) as info:
            o.parse_chat({"model": "m", "messages": turn, **extra}, 9)
        assert info.value.param == param, extra


def test_cached_event_equals_the_rendered_chunk():
    from workers import http_openai as o

    for kind in ("completion", "chat"):
        shape = o.ResponseShape(kind, "m\u00e9", "r7")
        for text in ("plain", 'quote " and \\ and \n', "\x00", "\u2603"):
            event = shape.text_event(text)
            assert event.startswith("data: ") and event.endswith("\n\n")
            assert json.loads(event[len("data: "):]) == shape.chunk(text, None)
