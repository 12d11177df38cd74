"""The OpenAI-compatible HTTP gateway: a sibling process of the front-end that speaks gmlx's
ZeroMQ protocol to it through ipc.client's AsyncClient (docs/http.md).

A process of its own keeps HTTP parsing out of the front-end's hot loop and lets the gateway
be restarted without touching requests of ZeroMQ clients. `gmlx serve --http URL` starts it;
`python -m workers.http_gateway --server ADDR --http URL` runs it against any server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import time

import anyio
import click
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ipc.client import AsyncClient, RequestError
from ipc.messages import MAX_MESSAGE_BYTES
from workers import http_openai as oai
from workers.http_config import GatewayConfig, model_id_for, parse_http_url, read_api_key
from workers.http_metrics import CONTENT_TYPE, GatewayMetrics

logger = logging.getLogger(__name__)

_END = object()

class _Relay:
    """One request's chunks from ipc.client's generator. Closing it (or cancelling a pending
    next) runs the generator's cleanup, which sends CANCEL for a request still running."""

    def __init__(self, client: AsyncClient, args: oai.GenerateArgs):
        self._chunks = client.generate(**args.client_kwargs())

    async def next(self):
        """The next chunk, or _END; raises what the client raised."""
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            return _END
        if chunk.finish_reason == "error":  # OpenAI has no such finish reason: it is an error reply
            raise RequestError("the request failed on the server", request_id=chunk.request_id)
        return chunk

    async def next_or_gone(self, disconnected: asyncio.Task):
        """next(), unless the HTTP client disconnects first (then ClientGone). Cancelled, it
        leaves no read running (close() may follow at once)."""
        item = asyncio.ensure_future(self.next())
        try:
            await asyncio.wait({item, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not item.done():
                item.cancel()
                await asyncio.wait({item})  # the generator's cleanup has run once this returns
        if item.cancelled():
            raise ClientGone()
        return item.result()

    async def close(self) -> None:
        # Shielded: Starlette cancels a stream's scope when its connection drops, and the
        # CANCEL must still go out.
        with anyio.CancelScope(shield=True):
            await self._chunks.aclose()


class ClientGone(Exception):
    pass


async def _first_chunks(relays: list[_Relay], disconnected: asyncio.Task) -> list:
    """Each relay's first chunk; raises the first refusal (or ClientGone) among them."""
    results = await asyncio.gather(*(relay.next_or_gone(disconnected) for relay in relays), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _chunks_of(first, read_next):
    """One request's chunks from its first to its final one (read_next: the relay's next or
    next_or_gone); RequestError where the stream ends without a finish reason."""
    chunk = first
    while chunk is not _END:
        yield chunk
        if chunk.finish_reason is not None:
            return
        chunk = await read_next()
    raise RequestError("the stream ended without a finish reason")


async def _merge(relays: list[_Relay], firsts: list):
    """(choice index, chunk) of every relay as each arrives, from its first chunk to its final one.
    One relay reads in place; several are read by a task each (closing this cancels them)."""
    if len(relays) == 1:
        async for chunk in _chunks_of(firsts[0], relays[0].next):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for chunk in _chunks_of(firsts[index], relays[index].next):
                await queue.put((index, chunk))
        except (RequestError, TimeoutError) as e:
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(relays))]
    try:
        num_open = len(relays)
        while num_open:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            num_open -= item.finish_reason is not None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(relays: list[_Relay]) -> None:
    for relay in relays:
        await relay.close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(status: int, message: str, error_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(oai.error_body(message, error_type, param, code), status_code=status)


def refusal(e: oai.BadRequest | RequestError | TimeoutError) -> JSONResponse:
    """The answer to a request refused before any token: by the gateway (its status), by the
    server (a 400 naming the field it blamed, else a 503: busy, no worker), or unanswered (503)."""
    if isinstance(e, oai.BadRequest):
        return error_response(e.status, str(e), e.error_type, e.param, e.code)
    if isinstance(e, RequestError):
        status, error_type = (400, "invalid_request_error") if e.field else (503, "server_busy")
        return error_response(status, str(e), error_type, e.field)
    return error_response(503, f"the gmlx server did not answer: {e}", "server_unavailable")


class Gateway:
    def __init__(self, config: GatewayConfig):
        config.validate()
        self.config = config
        self.metrics = GatewayMetrics()
        self._client: AsyncClient | None = None
        self._max_context_tokens = _max_context_tokens(config.model_path)

    @property
    def client(self) -> AsyncClient:
        if self._client is None:  # made inside the running loop: zmq.asyncio binds to it
            self._client = AsyncClient(self.config.server_address, timeout_s=self.config.timeout_s)
        return self._client

    def make_app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/metrics", self.metrics_page),
                  Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    # --- plain endpoints ----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            stats = await asyncio.wait_for(self.client.stats(), 5.0)
        except (TimeoutError, asyncio.TimeoutError, RequestError) as e:
            return JSONResponse({"status": "unavailable", "reason": str(e) or "no reply"}, status_code=503)
        if not stats.get("num_workers"):
            return JSONResponse({"status": "unavailable", "reason": "no worker is ready"}, status_code=503)
        return JSONResponse({"status": "ok", "num_workers": stats["num_workers"]})

    async def metrics_page(self, request: Request) -> Response:
        if (denied := self._check_auth(request)) is not None:
            return denied
        try:
            stats = await asyncio.wait_for(self.client.stats(), 5.0)
        except (TimeoutError, asyncio.TimeoutError, RequestError) as e:
            logger.warning("metrics without engine counters: %s", e)
            stats = None
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        if (denied := self._check_auth(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{id} (the SDK's models.retrieve): the card, or a 404."""
        if (denied := self._check_auth(request)) is not None:
            return denied
        try:
            self._check_model(request.path_params["model"])
        except oai.BadRequest as e:
            return refusal(e)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.config.model_id, "object": "model", "created": 0, "owned_by": "gmlx",
                "max_model_len": self._max_context_tokens}

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as a generation would prefill them."""
        async def answer(body) -> dict:
            args = oai.parse_tokenize(body)
            self._check_model(args.model)
            token_ids = await self.client.tokenize(**args.client_kwargs())
            return {"count": len(token_ids), "max_model_len": self._max_context_tokens, "tokens": token_ids}

        return await self._ask(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        async def answer(body) -> dict:
            model, token_ids = oai.parse_detokenize(body)
            self._check_model(model)
            return {"prompt": await self.client.detokenize(token_ids)}

        return await self._ask(request, answer)

    async def _ask(self, request: Request, answer) -> Response:
        """A question the server answers at once: its body parsed and answered, or an error."""
        if (denied := self._check_auth(request)) is not None:
            return denied
        try:
            return JSONResponse(await answer(await _read_json(request)))
        except (oai.BadRequest, RequestError, TimeoutError) as e:
            return refusal(e)

    def _check_model(self, model: str | None) -> None:
        """BadRequest (404) unless model is absent or the one served here."""
        if model is not None and model != self.config.model_id:
            raise oai.BadRequest(f"model {model!r} is not served here (this server has "
                                 f"{self.config.model_id!r})", "model", 404, code="model_not_found")

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(404, f"no route {request.url.path}", "invalid_request_error", code="not_found")

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error")

    def _check_auth(self, request: Request) -> Response | None:
        if self.config.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            return None
        return error_response(401, "a valid bearer token is required (Authorization: Bearer KEY)",
                              "authentication_error", code="invalid_api_key")

    # --- generation ---------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        started_s = time.monotonic()
        if (denied := self._check_auth(request)) is not None:
            return denied
        try:
            body = await _read_json(request)
            if kind == "chat":
                args = oai.parse_chat(body, default_max_tokens=self._max_context_tokens)
            else:
                args = oai.parse_completion(body)
            self._check_model(args.model)
        except oai.BadRequest as e:
            return self._rejected(endpoint, refusal(e))
        self.metrics.in_flight.inc()
        choices = args.choices()  # one server request per choice (prompts x n)
        relays = [_Relay(self.client, choice) for choice in choices]
        disconnected = asyncio.ensure_future(_wait_disconnect(request))
        is_streaming = False
        try:
            try:
                firsts = await _first_chunks(relays, disconnected)
            except (RequestError, TimeoutError) as e:
                return self._rejected(endpoint, refusal(e))
            shape = oai.ResponseShape(kind, args.model, firsts[0].request_id if firsts[0] is not _END else "0")
            self.metrics.ttft_s.observe(time.monotonic() - started_s)
            if args.is_stream:
                disconnected.cancel()  # from here StreamingResponse watches the connection
                is_streaming = True
                return StreamingResponse(self._events(relays, shape, args, choices, firsts, endpoint),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self._collect(relays, shape, args, choices, firsts, disconnected, endpoint)
        except ClientGone:
            self.metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            if not is_streaming:
                disconnected.cancel()
                await _close_all(relays)
                self.metrics.in_flight.dec()

    async def _collect(self, relays: list[_Relay], shape: oai.ResponseShape, args: oai.GenerateArgs,
                       choices: list[oai.GenerateArgs], firsts: list, disconnected, endpoint: str) -> Response:
        readers = [asyncio.ensure_future(self._collect_one(relay, choice, first, disconnected))
                   for relay, choice, first in zip(relays, choices, firsts)]
        try:
            answers = await asyncio.gather(*readers)
        except BaseException as e:
            for reader in readers:  # none may still read a relay when the caller closes them
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            if not isinstance(e, (RequestError, TimeoutError)):
                raise
            self.metrics.requests.labels(endpoint, "error").inc()
            return error_response(500, f"the request failed: {e}", "server_error")
        usage = oai.usage_of_choices([last.stats for _, _, last, _ in answers], args.num_per_prompt)
        self._count_finished(endpoint, answers[0][2].finish_reason, usage)
        if args.is_ranked:  # best_of: each prompt's best n
            answers = oai.best_of_each_prompt(answers, [score for *_, score in answers], args.num_per_prompt,
                                              args.num_returned)
        # Logprobs only where the request asked (best_of asks for them to rank its samples).
        return JSONResponse(shape.response([(text, oai.finish_reason_of(last.finish_reason),
                                             logprobs if args.num_logprobs is not None else None)
                                            for text, logprobs, last, _ in answers], usage))

    async def _collect_one(self, relay: _Relay, choice: oai.GenerateArgs, first, disconnected) -> tuple:
        """One choice read to its end: (text, logprobs entries or None, its final chunk, its
        completion's logprob per token: -inf unless logprobs were asked)."""
        texts, logprobs, generated, last_s = [], None, [], time.monotonic()
        async for chunk in _chunks_of(first, lambda: relay.next_or_gone(disconnected)):
            text, entries = choice.echoed(chunk, chunk is first)
            texts.append(text)
            if entries is not None:
                logprobs = [] if logprobs is None else logprobs
                logprobs.extend(entries)
            generated.extend(chunk.logprobs or ())
            now_s = time.monotonic()
            self.metrics.on_tokens(len(chunk.token_ids), None if chunk is first else now_s - last_s)
            last_s = now_s
        return "".join(texts), logprobs, chunk, oai.mean_logprob(generated)

    async def _events(self, relays: list[_Relay], shape: oai.ResponseShape, args: oai.GenerateArgs,
                      choices: list[oai.GenerateArgs], firsts: list, endpoint: str):
        """The server-sent events of one stream, every choice's as they come, ending with `data: [DONE]`."""
        finish, finals = "cancelled", {}
        merged = _merge(relays, firsts)
        try:
            if shape.kind == "chat":  # OpenAI's first chat chunk of a choice carries the role
                for index in range(len(relays)):
                    yield _sse(shape.chunk("", None, is_first=True, index=index))
            last_s = {}
            async for index, chunk in merged:
                now_s = time.monotonic()
                self.metrics.on_tokens(len(chunk.token_ids), now_s - last_s[index] if index in last_s else None)
                last_s[index] = now_s
                text, entries = choices[index].echoed(chunk, chunk is firsts[index])
                if chunk.finish_reason is None:
                    if entries is not None:  # tokens whose text is held back still send their logprobs
                        if text or entries:
                            yield _sse(shape.chunk(text, None, logprobs=entries, index=index))
                    elif text:
                        yield shape.text_event(text) if index == 0 else _sse(shape.chunk(text, None, index=index))
                    continue
                finals[index] = chunk
                usage = oai.usage_of(chunk.stats)
                yield _sse(shape.chunk(text, oai.finish_reason_of(chunk.finish_reason), usage, logprobs=entries,
                                       index=index))
            usage = oai.usage_of_choices([finals[i].stats for i in range(len(relays))], args.num_per_prompt)
            if args.is_usage_chunk:
                yield _sse(shape.usage_chunk(usage))
            finish = finals[0].finish_reason
            self._count_finished(endpoint, finish, usage)
            yield "data: [DONE]\n\n"
        except (RequestError, TimeoutError) as e:
            finish = "error"
            self.metrics.requests.labels(endpoint, "error").inc()
            yield _sse(oai.error_body(f"the request failed: {e}", "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            await _close_all(relays)  # a closed connection lands here: the client API sends CANCEL
            self.metrics.in_flight.dec()
            if finish == "cancelled":
                self.metrics.requests.labels(endpoint, "cancelled").inc()

    def _rejected(self, endpoint: str, response: JSONResponse) -> JSONResponse:
        self.metrics.rejected.labels(endpoint, str(response.status_code)).inc()
        return response

    def _count_finished(self, endpoint: str, finish_reason: str, usage: dict) -> None:
        self.metrics.requests.labels(endpoint, finish_reason).inc()
        self.metrics.prompt_tokens.inc(usage["prompt_tokens"])


async def _read_json(request: Request):
    """The body as JSON, read no further than the ZeroMQ side's message limit."""
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_MESSAGE_BYTES:
            raise oai.BadRequest(f"the body is over {MAX_MESSAGE_BYTES} bytes, the server's message limit",
                                 status=413)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise oai.BadRequest(f"the body is not JSON: {e}") from None
    except RecursionError:  # the parser recurses per level: a megabyte of "[" is that deep
        raise oai.BadRequest("the body nests arrays or objects too deeply") from None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _max_context_tokens(model_path: str | None) -> int:
    """The model's context from its config.json or GGUF metadata (the engine stops a request there anyway)."""
    from gmlx.config import BUILTIN_TARGET_DIR
    from gmlx.models.gguf_check import read_context_length

    try:
        if model_path is not None and model_path.endswith(".gguf"):
            return read_context_length(model_path) or 4096
        with open(os.path.join(model_path or str(BUILTIN_TARGET_DIR), "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings", 4096))
    except (OSError, ValueError, TypeError):
        return 4096


def serve_gateway(config: GatewayConfig) -> None:
    import uvicorn

    gateway = Gateway(config)
    logger.info("HTTP gateway on http://%s:%d for %s", config.host, config.port, config.server_address)
    uvicorn.run(gateway.make_app(), host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--server", "server_address", required=True, help="The front-end's client address (tcp://...).")
@click.option("--http", "http_url", default="http://127.0.0.1:8000", show_default=True, help="Where to listen.")
@click.option("--model", "model_path", default=None, help="The served model folder (default: built-in).")
@click.option("--http-api-key-file", default=None, help="File whose first line is the bearer token.")
@click.option("--timeout-s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Longest wait for one reply of the front-end.")
def main(server_address, http_url, model_path, http_api_key_file, timeout_s) -> None:
    """Serve the OpenAI-compatible HTTP API in front of a running gmlx server."""
    from gmlx.config import log_level

    logging.basicConfig(level=log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [http] %(name)s: %(message)s")
    try:
        host, port = parse_http_url(http_url)
        config = GatewayConfig(server_address=server_address, host=host, port=port, model_path=model_path,
                               model_id=model_id_for(model_path), api_key=read_api_key(http_api_key_file),
                               timeout_s=timeout_s)
        config.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    serve_gateway(config)


if __name__ == "__main__":
    main()
