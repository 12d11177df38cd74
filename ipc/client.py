"""Sync and asyncio clients for a gmlx server (docs/protocol.md, "Client link").

One DEALER socket per client carries every request: replies are routed to their stream by
the client's `ref` until ACCEPTED names the request id, then by the request id. Several
streams of one client may be iterated interleaved. Breaking out of a stream cancels its
request on the server.

A dead server is noticed without waiting for `timeout_s`: the socket sends ZeroMQ
heartbeats (a PING every 0.5 s; no traffic for 1.5 s drops the connection), and a dropped
connection (the server process died, or stopped answering) fails every stream in flight
with ServerLostError at once, within about 2 s of the server's death.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from ipc import messages as m
from ipc.auth import secure_client_socket
from ipc.sockets import recv_all

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_MS = 500  # ZMTP PING period on the client link
HEARTBEAT_TIMEOUT_MS = 1500  # no traffic for this long drops the connection (and fails its streams)


class RequestError(Exception):
    """The server rejected or failed a request; `field` names the bad field when one is to blame."""

    def __init__(self, message: str, field: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.field = field
        self.request_id = request_id


class ServerLostError(RequestError):
    """The connection to the server dropped while the request was in flight."""


@dataclass(frozen=True, slots=True)
class _Lost:
    message: str


class Chunk(m.Chunk, frozen=True):
    """The wire's CHUNK (token_ids, text, finish_reason, stats, request_id, seq, emitted_at_ns)
    as the caller gets it, stamped with when it arrived."""

    received_at_ns: int = 0  # this process's CLOCK_MONOTONIC when the chunk arrived


@dataclass(eq=False)
class _Stream:
    """One generate or stats exchange: its replies, and (generate) where the stream stands."""

    ref: str
    request_id: str | None = None
    inbox: deque = field(default_factory=deque)
    queue: asyncio.Queue | None = None  # the async client's inbox
    next_seq: int = -1  # -1 until the request is accepted, then the seq the next chunk must carry
    is_done: bool = False  # the last chunk or an error arrived

    def take(self, msg) -> Chunk | None:
        """The chunk to hand to the caller (None for the acceptance); raises RequestError
        for an ERROR or a lost chunk. Both clients drive their generate loops with it."""
        try:
            _check(msg, self, max(self.next_seq, 0))
        except RequestError:
            self.is_done = True
            raise
        self.next_seq += 1
        if self.next_seq == 0:
            return None
        self.is_done = msg.finish_reason is not None
        return msg

    def cancel_frames(self) -> list[bytes] | None:
        """A CANCEL for a stream the caller left before its end, else None."""
        if self.is_done or self.request_id is None:
            return None
        return m.encode_json(m.Cancel(request_id=self.request_id))


class _Router:
    """Sends replies to the stream they belong to; drops those of abandoned requests."""

    def __init__(self):
        self._prefix = f"{os.getpid():x}-{id(self):x}-"
        self._refs = itertools.count()
        self._by_ref: dict[str, _Stream] = {}
        self._by_request_id: dict[str, _Stream] = {}

    def open(self, is_async: bool = False) -> _Stream:
        stream = _Stream(f"{self._prefix}{next(self._refs)}", queue=asyncio.Queue() if is_async else None)
        self._by_ref[stream.ref] = stream
        return stream

    def close(self, stream: _Stream) -> None:
        self._by_ref.pop(stream.ref, None)
        if stream.request_id is not None:
            self._by_request_id.pop(stream.request_id, None)

    def fail_all(self, message: str) -> list[tuple[_Stream, _Lost]]:
        """What to hand every unfinished stream when the connection drops."""
        return [(s, _Lost(message)) for s in self._by_ref.values() if not s.is_done]

    def route(self, frames: list[bytes]) -> tuple[_Stream | None, object]:
        try:
            msg = m.decode_json(frames)
        except m.WireError as e:
            logger.warning("dropping an undecodable reply: %s", e)
            return None, None
        if isinstance(msg, m.Accepted):
            stream = self._by_ref.get(msg.ref)
            if stream is not None:
                stream.request_id = msg.request_id
                self._by_request_id[msg.request_id] = stream
        elif isinstance(msg, m.Chunk):
            stream = self._by_request_id.get(msg.request_id)
            msg = _to_chunk(msg)
        elif isinstance(msg, m.Error) and msg.request_id is not None:
            stream = self._by_request_id.get(msg.request_id) or self._by_ref.get(msg.ref)
        else:
            stream = self._by_ref.get(getattr(msg, "ref", None))
        return stream, msg

    def route_all(self, replies) -> Iterator[tuple[_Stream, object]]:
        """(stream, message) for each reply that belongs to an open stream."""
        for frames in replies:
            stream, msg = self.route(frames)
            if stream is not None:
                yield stream, msg


def _to_chunk(msg: m.Chunk) -> Chunk:
    return Chunk(**msgspec.structs.asdict(msg), received_at_ns=time.monotonic_ns())


def _generate_message(ref: str, prompt, token_ids, messages, stop, **sampling) -> list[bytes]:
    """A GENERATE; `sampling` holds exactly m.Sampling's fields, as generate() takes them."""
    if isinstance(stop, str):
        stop = [stop]
    if messages is not None:
        messages = _chat_messages(messages)
    token_ids = None if token_ids is None else list(token_ids)
    try:
        return m.encode_json(m.Generate(ref=ref, prompt=prompt, token_ids=token_ids, messages=messages,
                                        stop=None if stop is None else list(stop), **sampling))
    except UnicodeEncodeError:
        raise _not_unicode(prompt, messages, stop) from None


def _tokenize_message(ref: str, prompt, messages) -> list[bytes]:
    """A TOKENIZE, as generate() would send the same prompt or messages."""
    messages = None if messages is None else _chat_messages(messages)
    try:
        return m.encode_json(m.Tokenize(ref=ref, prompt=prompt, messages=messages))
    except UnicodeEncodeError:
        raise _not_unicode(prompt, messages) from None


def _not_unicode(prompt, messages, stop=None) -> ValueError:
    """The error naming the field whose text UTF-8 cannot carry (a lone surrogate)."""
    texts = {"prompt": [prompt], "stop": stop or [],
             "messages": [text for turn in messages or [] for text in (turn.role, turn.content)]}
    field = next(name for name, values in texts.items() if any(not _is_utf8(v) for v in values))
    return ValueError(f"{field}: not valid Unicode text (a lone surrogate, which UTF-8 cannot carry)")


def _chat_messages(messages) -> list[m.ChatMessage]:
    try:
        return [m.ChatMessage(role=turn["role"], content=turn["content"]) for turn in messages]
    except (KeyError, TypeError):
        raise ValueError(f"messages: each entry needs a role and a content, got {messages!r:.200}") from None


def _is_utf8(text) -> bool:
    """Whether text encodes as UTF-8 (what is not a str the encoder took as it is)."""
    if not isinstance(text, str):
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(msg, stream: _Stream, expected_seq: int):
    """Raise for an ERROR or a lost chunk; otherwise return the message."""
    if isinstance(msg, m.Error):
        raise RequestError(msg.message, msg.field, msg.request_id or stream.request_id)
    if isinstance(msg, _Lost):
        raise ServerLostError(msg.message, None, stream.request_id)
    if isinstance(msg, Chunk) and msg.seq != expected_seq:
        raise RequestError(f"chunk {expected_seq} of {stream.request_id} was lost (got {msg.seq})")
    return msg


def _make_socket(ctx, address: str, curve_dir: str | None):
    sock = ctx.socket(zmq.DEALER)
    if curve_dir is not None:
        secure_client_socket(sock, curve_dir)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # replies are never dropped: the server sends each once
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return sock, monitor


def _lost_message(address: str) -> str:
    return f"lost the connection to the server at {address} (it died or stopped answering)"


class Client:
    """A blocking client. Not thread-safe: use one per thread."""

    def __init__(self, address: str, timeout_s: float = 30.0, curve_dir: str | None = None):
        """curve_dir: a `gmlx keys` folder (server.key, client.key_secret) for a CURVE server."""
        self.address = address
        self.timeout_s = timeout_s
        self._sock, self._monitor = _make_socket(zmq.Context.instance(), address, curve_dir)
        self._router = _Router()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def generate(self, prompt: str | None = None, *, token_ids=None, max_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop=None, min_p: float = 0.0, messages=None, speculate: bool = True,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=None,
                 repetition_penalty: float = 1.0, ignore_eos: bool = False, min_tokens: int = 0,
                 stop_token_ids=()):
        """Yield Chunk objects as the server decodes; raises RequestError if it rejects the request.

        Give one of prompt, token_ids or messages ([{"role": ..., "content": ...}, ...], rendered
        with the model's chat template). speculate=False pins the request to plain decoding.
        logprobs=N (0..20): each chunk's `logprobs` holds every token's logprob and the N likeliest;
        prompt_logprobs=N: the first chunk's `prompt_logprobs` holds the same for the prompt's tokens.
        presence_penalty and frequency_penalty (in [-2, 2]) are OpenAI's repeat penalties;
        logit_bias ({token id: number in [-100, 100]}, at most 300) is OpenAI's too.
        repetition_penalty (in (0, 10], 1 = off) is transformers': a prompt's or an earlier
        answer token's logit is divided by it where positive, else multiplied. ignore_eos,
        min_tokens and stop_token_ids (at most 64) are vLLM's: EOS ends nothing; EOS and the stop
        token ids are not sampled before min_tokens; the stop token ids end it as EOS does."""
        stream = self._router.open()
        try:
            self._sock.send_multipart(_generate_message(
                stream.ref, prompt, token_ids, messages, stop, max_tokens=max_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, speculate=speculate, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, logit_bias=logit_bias, repetition_penalty=repetition_penalty,
                ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=tuple(stop_token_ids)))
            while not stream.is_done:
                chunk = stream.take(self._next(stream))
                if chunk is not None:
                    yield chunk
        finally:
            cancel = stream.cancel_frames()
            if cancel is not None and not self._sock.closed:
                self._sock.send_multipart(cancel)
            self._router.close(stream)

    def stats(self) -> dict:
        """The engine counters, summed over the server's workers."""
        return self._ask(lambda ref: m.encode_json(m.StatsRequest(ref=ref))).stats

    def tokenize(self, prompt: str | None = None, *, messages=None) -> list[int]:
        """The token ids generate() would prefill for this prompt, or for these messages rendered
        with the model's chat template; RequestError naming the field if the server refuses."""
        return self._ask(lambda ref: _tokenize_message(ref, prompt, messages)).token_ids

    def detokenize(self, token_ids) -> str:
        """The text of token ids, decoded as the streams decode them (special tokens kept)."""
        return self._ask(lambda ref: m.encode_json(m.Detokenize(ref=ref, token_ids=list(token_ids)))).text

    def _ask(self, make_frames):
        """One question, one answer: the reply to the message make_frames(ref), or RequestError."""
        stream = self._router.open()
        try:
            self._sock.send_multipart(make_frames(stream.ref))
            return _check(self._next(stream), stream, 0)
        finally:
            self._router.close(stream)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _next(self, stream: _Stream):
        deadline_s = time.monotonic() + self.timeout_s
        while not stream.inbox:
            timeout_ms = int((deadline_s - time.monotonic()) * 1000)
            events = dict(self._poller.poll(timeout_ms)) if timeout_ms > 0 else {}
            if not events:
                raise TimeoutError(f"no reply from {self.address} within {self.timeout_s} s")
            if self._monitor in events:
                recv_monitor_message(self._monitor)  # only EVENT_DISCONNECTED is subscribed
                for target, lost in self._router.fail_all(_lost_message(self.address)):
                    target.inbox.append(lost)
            # Everything that has arrived, whichever stream it is for.
            for target, msg in self._router.route_all(recv_all(self._sock)):
                target.inbox.append(msg)
        return stream.inbox.popleft()


class AsyncClient:
    """The asyncio twin of Client: `async for chunk in client.generate(...)`."""

    def __init__(self, address: str, timeout_s: float = 30.0, curve_dir: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._sock, self._monitor = _make_socket(zmq.asyncio.Context.instance(), address, curve_dir)
        # The same socket without futures, to read what has already arrived at once: a future
        # per message cost ~100 us of client CPU a token at 8 streams, against ~80 this way.
        self._ready_sock = zmq.Socket.shadow(self._sock.underlying)
        self._router = _Router()
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def generate(self, prompt: str | None = None, *, token_ids=None, max_tokens: int = 64,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop=None, min_p: float = 0.0, messages=None, speculate: bool = True,
                       logprobs: int | None = None, prompt_logprobs: int | None = None,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=None,
                       repetition_penalty: float = 1.0, ignore_eos: bool = False, min_tokens: int = 0,
                       stop_token_ids=()):
        """Client.generate's asyncio twin (same arguments)."""
        stream = self._open()
        try:
            await self._sock.send_multipart(_generate_message(
                stream.ref, prompt, token_ids, messages, stop, max_tokens=max_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, speculate=speculate, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, logit_bias=logit_bias, repetition_penalty=repetition_penalty,
                ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=tuple(stop_token_ids)))
            while not stream.is_done:
                chunk = stream.take(await self._next(stream))
                if chunk is not None:
                    yield chunk
        finally:
            cancel = stream.cancel_frames()
            if cancel is not None and not self._sock.closed:
                await self._sock.send_multipart(cancel)
            self._router.close(stream)

    async def stats(self) -> dict:
        return (await self._ask(lambda ref: m.encode_json(m.StatsRequest(ref=ref)))).stats

    async def tokenize(self, prompt: str | None = None, *, messages=None) -> list[int]:
        """Client.tokenize's asyncio twin."""
        return (await self._ask(lambda ref: _tokenize_message(ref, prompt, messages))).token_ids

    async def detokenize(self, token_ids) -> str:
        """Client.detokenize's asyncio twin."""
        return (await self._ask(lambda ref: m.encode_json(m.Detokenize(ref=ref, token_ids=list(token_ids))))).text

    async def _ask(self, make_frames):
        stream = self._open()
        try:
            await self._sock.send_multipart(make_frames(stream.ref))
            return _check(await self._next(stream), stream, 0)
        finally:
            self._router.close(stream)

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def _open(self) -> _Stream:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_connection())
        return self._router.open(is_async=True)

    async def _watch_connection(self) -> None:
        while True:
            parse_monitor_message(await self._monitor.recv_multipart())
            for target, lost in self._router.fail_all(_lost_message(self.address)):
                target.queue.put_nowait(lost)

    async def _read_forever(self) -> None:
        while True:
            first = await self._sock.recv_multipart()
            # Then everything else that has arrived, whichever stream it is for.
            for target, msg in self._router.route_all(itertools.chain([first], recv_all(self._ready_sock))):
                target.queue.put_nowait(msg)

    async def _next(self, stream: _Stream):
        if not stream.queue.empty():
            return stream.queue.get_nowait()
        try:
            async with asyncio.timeout(self.timeout_s):  # no task per wait, unlike wait_for
                return await stream.queue.get()
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.address} within {self.timeout_s} s") from None
