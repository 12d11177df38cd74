"""The front-end process: clients in, requests onto the bus, token streams back out.

Sockets (docs/protocol.md has the frames):
  clients  ROUTER bound at the client address; each client's DEALER sends GENERATE /
           CANCEL / STATS and receives ACCEPTED, CHUNK, ERROR and STATS replies on the
           same connection, so a client's token stream needs no second socket.
  workers  ROUTER bound at the worker address; each worker's DEALER is its injection
           queue (INJECT, ABORT, STATS queries, PING, SHUTDOWN in; HELLO, TAKEN, stats
           answers out).
  rounds   SUB bound beside it; every worker's PUB connects here and publishes one ROUND
           message per engine step, plus READY, heartbeats and DEAD.
This process never imports mlx: it loads only the tokenizer (transformers) and
gmlx.textstream, and the worker's decode thread never detokenizes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from gmlx.textstream import TextStream, TokenTexts
from ipc import messages as m
from ipc.auth import (ServerAuth, default_secret_path, insecure_bind_message, insecure_worker_bind_message,
                      is_loopback, read_worker_secret, write_worker_secret)
from ipc.bus import RequestBus, reclaim_stale_segments
from ipc.sockets import bind_router, bind_sub_beside, recv_all, recv_all_bounded
from workers.streams import MAX_WORKER_LOSSES, ClientRequest, Phase
from workers.stats import StatsQueries, merge_worker_stats
from workers.supervisor import EXIT_FRONTEND_FAILED, WorkerHandle, WorkerPool, WorkerSpec, WorkerState
from workers.tokenizer import load_tokenizer, max_token_bytes
from workers.validate import (InvalidRequest, ModelLimits, detokenize, prompt_byte_limit, tokenize,
                              validate_generate)

logger = logging.getLogger(__name__)

POLL_MS = 20  # the loop's longest sleep: bounds how late a dead worker is noticed
BUSY_RETRY_AFTER_MS = 200  # the hint in a "busy" ERROR: about one pending batch's worth of rounds


def _handle_worker_frames(frames: list[bytes], what: str, handle) -> None:
    """Decode one message from the worker side and handle it; a bad or failing one is
    logged and dropped, never the front-end."""
    try:
        msg = m.decode_msgpack(frames)
    except m.WireError as e:
        logger.warning("dropping a bad %s message: %s", what, e)
        return
    try:
        handle(msg)
    except Exception:  # a malformed but decodable message
        logger.exception("dropping a %s %s message that failed", what, type(msg).__name__)


@dataclass
class FrontendConfig:
    address: str = "tcp://127.0.0.1:5555"  # where clients connect
    worker_address: str = "tcp://127.0.0.1:*"  # where workers connect; port * = any free one
    num_workers: int = 1  # workers this process starts (0 = only gmlx-worker processes started by hand)
    drain_timeout_s: float = 30.0  # after SIGTERM, in-flight requests get this long to finish
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0  # a ready worker silent this long is dead (heartbeats come from a thread, mid-round too)
    startup_timeout_s: float = 300.0  # spawn -> READY
    num_bus_slots: int = 64
    max_prompt_tokens: int = 32768  # bus slot capacity
    max_pending_requests: int = 4096  # accepted but not yet on a worker
    stats_timeout_s: float = 2.0
    curve_dir: str | None = None  # `gmlx keys` folder: clients must authenticate with CURVE
    is_insecure: bool = False  # allow a non-loopback client address without CURVE keys
    worker_secret_file: str | None = None  # owner-only file with the worker secret (None: make one)
    worker_curve_dir: str | None = None  # `gmlx keys` folder: workers authenticate with CURVE (needed off loopback)


class Frontend:
    def __init__(self, config: FrontendConfig, spec: WorkerSpec):
        self.config = config
        self.spec = spec
        self._context = zmq.Context()
        self._bus: RequestBus | None = None
        self._pool: WorkerPool | None = None
        self._tokenizer = None  # transformers' tokenizer, for encode
        self._decoder = None  # the same, with a fast decode for the text streams
        self._token_texts: TokenTexts | None = None  # each token's own text, for logprobs entries
        self._model_path: str | None = None
        self._limits: ModelLimits | None = None
        self._requests: dict[str, ClientRequest] = {}
        self._pending: deque[ClientRequest] = deque()
        self._request_ids = itertools.count(1)
        self._stats_queries = StatsQueries(config.stats_timeout_s)
        self._is_serving = False
        self._is_stop_requested = False
        self._drain_deadline_s: float | None = None
        self._last_ping_s = 0.0
        self.num_rejected = 0  # requests answered with an ERROR before acceptance
        self.num_cancelled = 0  # requests cancelled by their client (or found abandoned)
        self.num_carried_over = 0  # requests moved to another worker when theirs died

    def request_stop(self) -> None:
        """Begin draining (signal-handler safe: it only sets a flag)."""
        self._is_stop_requested = True

    def run(self, on_ready) -> int:
        """Serve until stopped; calls on_ready(address) once requests are accepted."""
        try:
            self._start()  # ValueError naming an address that cannot be bound
            return self._loop(on_ready)
        finally:
            self._shutdown()

    def _loop(self, on_ready) -> int:
        try:
            while True:
                self._poll_once()
                error = self._housekeeping()
                if error is not None:
                    logger.error("startup failed: %s", error)
                    return 1
                if not self._is_serving and self._can_serve():
                    self._is_serving = True
                    self._poller.register(self._clients, zmq.POLLIN)
                    on_ready(self.config.address)
                if self._drain_deadline_s is not None and not self._requests:
                    logger.info("drained; shutting down")
                    return 0
        except Exception:  # a front-end bug: fail loudly, but still stop the workers and unlink the bus
            logger.exception("the front-end failed")
            return EXIT_FRONTEND_FAILED if self._is_serving else 1

    # --- start and stop ------------------------------------------------------------------

    def _start(self) -> None:
        # transformers takes seconds to import: overlap it with the workers loading the model.
        self._tokenizer_import = threading.Thread(target=_import_tokenizer_lib, daemon=True)
        self._tokenizer_import.start()
        config = self.config
        if not is_loopback(config.address) and config.curve_dir is None and not config.is_insecure:
            raise ValueError(insecure_bind_message(config.address))
        if not is_loopback(config.worker_address) and config.worker_curve_dir is None:
            raise ValueError(insecure_worker_bind_message(config.worker_address))
        ctx = self._context
        self._auth = ServerAuth(ctx, config.curve_dir, config.worker_curve_dir)
        reclaim_stale_segments()
        self._bus = RequestBus.create(self.config.num_bus_slots, self.config.max_prompt_tokens)
        self._clients = bind_router(ctx, self.config.address, m.MAX_CLIENT_FRAME_BYTES, self._auth.secure_clients)
        self._workers = bind_router(ctx, self.config.worker_address, secure=self._auth.secure_workers)
        worker_endpoint = self._workers.getsockopt_string(zmq.LAST_ENDPOINT)
        if config.worker_curve_dir is not None:  # CURVE keys replace the secret for every worker
            secret_path = None
            self.spec = dataclasses.replace(self.spec, curve_dir=str(config.worker_curve_dir))
        elif config.worker_secret_file is not None:
            secret, secret_path = read_worker_secret(config.worker_secret_file), config.worker_secret_file
        else:  # where a gmlx-worker of this user connecting to this address looks by default
            secret_path = default_secret_path(worker_endpoint)
            secret = write_worker_secret(secret_path)
            self._secret_path = secret_path
        if secret_path is not None:
            self._auth.allow_workers(secret)
            self.spec = dataclasses.replace(self.spec, secret_file=str(secret_path))
        self._rounds = bind_sub_beside(ctx, worker_endpoint, self._auth.secure_workers)
        self._rounds_endpoint = self._rounds.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._workers, zmq.POLLIN)
        self._poller.register(self._rounds, zmq.POLLIN)
        self._pool = WorkerPool(self.spec, worker_endpoint, self.config.heartbeat_timeout_s,
                                self.config.startup_timeout_s)
        for _ in range(self.config.num_workers):
            self._pool.spawn()
        logger.info("front-end: clients at %s, workers at %s, rounds at %s (a worker started by hand needs %s)",
                    self.config.address, worker_endpoint, self._rounds_endpoint,
                    f"--secret-file {secret_path}" if secret_path else f"--curve-dir with {config.worker_curve_dir}'s "
                    "server.key and worker.key_secret")

    def _can_serve(self) -> bool:
        num_ready = len(self._pool.ready_workers())
        return self._tokenizer is not None and num_ready >= max(1, self.config.num_workers)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.stop_all(lambda w: self._send_worker(w, m.Shutdown()))
        for name in ("_clients", "_workers", "_rounds"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=1000 if name == "_clients" else 0)  # let final chunks out
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
        self._context.term()
        if getattr(self, "_secret_path", None) is not None:
            self._secret_path.unlink(missing_ok=True)
        if self._bus is not None:
            self._bus.close()
            self._bus = None

    # --- the loop ------------------------------------------------------------------------

    def _poll_once(self) -> None:
        events = dict(self._poller.poll(POLL_MS))
        if self._rounds in events:
            for frames in recv_all(self._rounds):
                self._on_published(frames)
        if self._workers in events:
            for frames in recv_all(self._workers):
                self._on_worker_message(frames[0], frames[1:])
        if self._clients in events:
            for frames in recv_all_bounded(self._clients, max_parts=3):  # routing id, tag, body
                self._on_client_message(frames[0], frames[1:])

    def _housekeeping(self) -> str | None:
        """Health checks, restarts, pings, timeouts; returns an error if startup failed."""
        for handle, reason in self._pool.find_dead():
            if not self._is_serving and handle.proc is not None:
                return reason
            self._on_worker_dead(handle, reason)
        now_s = time.monotonic()
        if self._is_stop_requested and self._drain_deadline_s is None:
            logger.info("stop requested: draining %d requests", len(self._requests))
            self._drain_deadline_s = now_s + self.config.drain_timeout_s
        if self._drain_deadline_s is not None and now_s > self._drain_deadline_s:
            for req in list(self._requests.values()):
                self._send_client(req, req.fail("the server shut down before the request finished"))
        elif self._drain_deadline_s is None:
            self._pool.restart_due()
        if now_s - self._last_ping_s >= self.config.heartbeat_interval_s:
            self._last_ping_s = now_s
            for w in list(self._pool.workers.values()):
                if w.routing_id is not None:
                    self._send_worker(w, m.Ping())
        self._answer_stats()
        return None

    # --- clients -------------------------------------------------------------------------

    def _on_client_message(self, client_id: bytes, frames: list[bytes]) -> None:
        # Whatever one message does, it fails only itself: the loop and other requests go on.
        try:
            msg = m.decode_json(frames)
            if not isinstance(msg, m.CLIENT_TO_SERVER):
                raise m.WireError(f"{type(msg).__name__} is not a client message", field="type")
        except m.WireError as e:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message=str(e), ref=m.readable_ref(frames), field=e.field))
            return
        try:
            if isinstance(msg, m.Generate):
                self._on_generate(client_id, msg)
            elif isinstance(msg, m.Cancel):
                self._on_cancel(client_id, msg.request_id)
            elif isinstance(msg, (m.Tokenize, m.Detokenize)):
                self._on_tokenize(client_id, msg)
            else:
                self._on_stats(client_id, msg.ref)
        except Exception as e:  # a front-end bug met by this message: answer it, keep serving
            logger.exception("a %s message failed", type(msg).__name__)
            self.num_rejected += 1
            ref = getattr(msg, "ref", None)
            self._reply(client_id, m.Error(message=f"internal error: {type(e).__name__}",
                                           ref=ref if isinstance(ref, str) else None))

    def _on_generate(self, client_id: bytes, msg: m.Generate) -> None:
        if self._drain_deadline_s is not None:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message="the server is shutting down", ref=msg.ref))
            return
        if len(self._pending) >= self.config.max_pending_requests:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message="the server is busy", ref=msg.ref,
                                           retry_after_ms=BUSY_RETRY_AFTER_MS))
            return
        try:
            payload, stop = validate_generate(msg, self._tokenizer, self._limits)
        except InvalidRequest as e:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message=str(e), ref=msg.ref, field=e.field))
            return
        request_id = f"r{next(self._request_ids)}"
        req = ClientRequest(request_id, msg.ref, client_id, payload,
                            TextStream(self._decoder, stop, self._token_texts), self._model_path, has_stop=bool(stop))
        self._requests[request_id] = req
        self._pending.append(req)
        self._reply(client_id, m.Accepted(ref=msg.ref, request_id=request_id,
                                          prompt_tokens=len(payload.token_ids), model=self._model_path))
        self._dispatch()

    def _on_tokenize(self, client_id: bytes, msg: m.Tokenize | m.Detokenize) -> None:
        """TOKENIZE / DETOKENIZE: answered at once with the model's tokenizer; no worker is asked."""
        if self._tokenizer is None:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message="no model is loaded yet", ref=msg.ref,
                                           retry_after_ms=BUSY_RETRY_AFTER_MS))
            return
        try:
            if isinstance(msg, m.Tokenize):
                reply = m.Tokens(ref=msg.ref, token_ids=tokenize(msg, self._tokenizer, self._limits),
                                 max_prompt_tokens=self._limits.max_prompt_tokens)
            else:
                reply = m.Text(ref=msg.ref, text=detokenize(msg, self._decoder, self._limits))
        except InvalidRequest as e:
            self.num_rejected += 1
            self._reply(client_id, m.Error(message=str(e), ref=msg.ref, field=e.field))
            return
        self._reply(client_id, reply)

    def _on_cancel(self, client_id: bytes, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.client_id != client_id:
            return  # finished already, or not this client's to cancel
        if req.phase in (Phase.PENDING, Phase.INJECTED):
            self.num_cancelled += 1
        if req.phase == Phase.PENDING:
            self._send_client(req, req.cancelled())
        elif req.phase == Phase.INJECTED:
            req.phase = Phase.STOPPING  # the worker's final output closes it, with stats
            self._send_worker(self._pool.workers.get(req.worker_id), m.Abort(request_id=request_id))

    def _send_client(self, req: ClientRequest, msg: m.Message) -> None:
        if not self._reply(req.client_id, msg) and not req.phase.is_finished:
            # The client is gone: stop spending decode work on it.
            self._on_cancel(req.client_id, req.request_id)
        if req.phase.is_finished:
            self._forget(req)

    def _reply(self, client_id: bytes, msg: m.Message) -> bool:
        try:
            self._clients.send_multipart([client_id, *m.encode_json(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: disconnected; EAGAIN: not reading
            logger.warning("cannot reach client %s: %s", client_id.hex(), e)
            return False

    def _forget(self, req: ClientRequest) -> None:
        self._requests.pop(req.request_id, None)
        worker = self._pool.workers.get(req.worker_id)
        if worker is not None:
            worker.request_ids.discard(req.request_id)
        if req in self._pending:
            self._pending.remove(req)

    # --- workers -------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Move pending requests onto the least loaded ready workers while slots last."""
        while self._pending:
            worker = self._pool.least_loaded()
            if worker is None:
                return
            req = self._pending[0]
            if not worker.has_bus:  # another host: the payload rides in the message, no slot to free
                self._pending.popleft()
                req.phase, req.worker_id = Phase.INJECTED, worker.worker_id
                worker.request_ids.add(req.request_id)
                self._send_worker(worker, m.Inject(request_id=req.request_id, slot=-1, generation=0,
                                                   payload=req.payload))
                continue
            try:
                placed = self._bus.write(req.payload)
            except ValueError as e:  # validation should have caught it; fail this request only
                logger.error("request %s does not fit the bus: %s", req.request_id, e)
                self._pending.popleft()
                self._send_client(req, req.fail(f"the request cannot be carried to a worker: {e}"))
                continue
            if placed is None:
                return  # the bus is full: a TAKEN frees a slot
            slot, generation = placed
            self._pending.popleft()
            req.phase, req.worker_id = Phase.INJECTED, worker.worker_id
            worker.request_ids.add(req.request_id)
            worker.slots.add(slot)
            self._send_worker(worker, m.Inject(request_id=req.request_id, slot=slot, generation=generation))

    def _send_worker(self, worker: WorkerHandle | None, msg: m.Message) -> None:
        if worker is not None and worker.routing_id is not None:
            self._send_routing(worker.routing_id, msg)

    def _send_routing(self, routing_id: bytes, msg: m.Message) -> None:
        try:
            self._workers.send_multipart([routing_id, *m.encode_msgpack(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone: the health check will see it exit or fall silent
            logger.warning("cannot reach worker %s: %s", routing_id.hex(), e)

    def _on_worker_message(self, routing_id: bytes, frames: list[bytes]) -> None:
        _handle_worker_frames(frames, "worker", lambda msg: self._on_worker_decoded(routing_id, msg))

    def _on_worker_decoded(self, routing_id: bytes, msg: m.Message) -> None:
        if isinstance(msg, m.Hello):
            self._on_hello(routing_id, msg)
            return
        worker = next((w for w in self._pool.workers.values() if w.routing_id == routing_id), None)
        if worker is None:  # one declared dead that still talks: make it exit
            self._send_routing(routing_id, m.Shutdown())
            return
        worker.last_seen_s = time.monotonic()
        if isinstance(msg, m.Taken):
            for slot in msg.slots:
                if slot in worker.slots:
                    worker.slots.remove(slot)
                    self._bus.release(slot)
            self._dispatch()
        elif isinstance(msg, m.StatsAnswer):
            self._stats_queries.on_answer(msg.query_id, worker.worker_id, msg.stats)
            self._answer_stats()
        elif isinstance(msg, m.Dead):
            self._on_worker_dead(worker, f"worker {worker.worker_id} failed: {msg.message}")

    def _on_hello(self, routing_id: bytes, hello: m.Hello) -> None:
        if self._model_path is None:
            self._load_tokenizer(hello)
        elif hello.model_path != self._model_path:
            logger.error("worker pid %d serves %s, not %s: refused", hello.pid, hello.model_path, self._model_path)
            self._send_routing(routing_id, m.Shutdown())
            return
        worker = self._pool.on_hello(routing_id, hello.pid)
        self._send_worker(worker, m.Welcome(worker_id=worker.worker_id, pub_address=self._rounds_endpoint,
                                           bus_name=self._bus.name,
                                           heartbeat_interval_s=self.config.heartbeat_interval_s))

    def _load_tokenizer(self, hello: m.Hello) -> None:
        self._tokenizer_import.join()  # transformers' lazy module breaks under concurrent imports
        self._tokenizer, self._decoder = load_tokenizer(hello.model_path)
        self._token_texts = TokenTexts(self._decoder)
        self._model_path = hello.model_path
        max_prompt_tokens = min(hello.max_context_tokens - 1, self._bus.max_tokens)
        max_prompt_bytes = prompt_byte_limit(max_prompt_tokens, max_token_bytes(self._tokenizer))
        self._limits = ModelLimits(vocab_size=hello.vocab_size, max_prompt_tokens=max_prompt_tokens,
                                   max_prompt_bytes=max_prompt_bytes)
        logger.info("tokenizer loaded from %s", hello.model_path)

    def _on_published(self, frames: list[bytes]) -> None:
        _handle_worker_frames(frames, "published", self._on_published_decoded)

    def _on_published_decoded(self, msg: m.Message) -> None:
        if not hasattr(msg, "worker_id"):
            return
        worker = self._pool.workers.get(msg.worker_id)
        if worker is None:
            return
        worker.last_seen_s = time.monotonic()
        if isinstance(msg, m.Round):
            for row in msg.outputs:
                req = self._requests.get(row.request_id)
                if req is None or req.worker_id != worker.worker_id:
                    continue
                outcome = req.on_row(row, msg.emitted_at_ns)
                if outcome.is_cancel_needed:
                    self._send_worker(worker, m.Abort(request_id=req.request_id, is_stop=req.stop_reason == "stop"))
                for reply in outcome.messages:
                    self._send_client(req, reply)
        elif isinstance(msg, m.Ready) and worker.state == WorkerState.WELCOMED:
            worker.has_bus = msg.has_bus
            self._pool.mark_ready(worker)
            self._send_worker(worker, m.Start())
            logger.info("worker %d ready (%s)", worker.worker_id,
                        "shared-memory bus" if msg.has_bus else "payloads inline: no bus")
            self._dispatch()
        elif isinstance(msg, m.Dead):
            self._on_worker_dead(worker, f"worker {worker.worker_id} failed: {msg.message}")

    def _on_worker_dead(self, worker: WorkerHandle, reason: str) -> None:
        if worker.state == WorkerState.DEAD:
            return
        carried, lost = [], []
        for request_id in sorted(worker.request_ids, key=lambda r: int(r[1:])):
            req = self._requests.get(request_id)
            if req is None:
                continue
            if req.phase == Phase.STOPPING:  # the client has every token it is owed
                self._send_client(req, req.stopped_without_worker())
            else:
                (carried if req.carry_over() else lost).append(req)
        self.num_carried_over += len(carried)
        logger.error("%s; %d requests carried over to the next worker, %d lost", reason, len(carried), len(lost))
        for req in lost:
            self._send_client(req, req.fail(f"{reason}; the request was lost after {req.num_worker_losses + 1} "
                                            f"worker failures (at most {MAX_WORKER_LOSSES} are carried over)"))
        for req in reversed(carried):
            self._pending.appendleft(req)
        worker.request_ids.clear()
        for slot in worker.slots:
            self._bus.release(slot)
        worker.slots.clear()
        self._stats_queries.on_worker_gone(worker.worker_id)
        self._pool.remove(worker, is_restarting=self._drain_deadline_s is None and worker.proc is not None)
        self._dispatch()

    # --- stats ---------------------------------------------------------------------------

    def _on_stats(self, client_id: bytes, ref: str) -> None:
        ready = self._pool.ready_workers()
        query_id = self._stats_queries.open(client_id, ref, {w.worker_id for w in ready})
        for worker in ready:
            self._send_worker(worker, m.StatsQuery(query_id=query_id))
        self._answer_stats()

    def _answer_stats(self) -> None:
        for query in self._stats_queries.pop_complete():
            stats = merge_worker_stats(query.parts)
            for entry in stats["workers"]:  # which process is which worker, for an operator (or a test) to act on
                handle = self._pool.workers.get(entry["worker_id"])
                entry["pid"] = handle.pid if handle is not None else None
            stats["num_queued"] += len(self._pending)  # accepted, waiting for a worker
            stats.update(num_workers=len(self._pool.ready_workers()), num_worker_restarts=self._pool.num_restarts,
                         num_frontend_requests=len(self._requests), num_frontend_pending=len(self._pending),
                         num_bus_free_slots=self._bus.num_free_slots, num_rejected=self.num_rejected,
                         num_cancelled=self.num_cancelled, num_carried_over=self.num_carried_over,
                         model=self._model_path)
            self._reply(query.client_id, m.StatsReply(ref=query.ref, stats=stats))


def _import_tokenizer_lib() -> None:
    from transformers import AutoTokenizer  # noqa: F401
