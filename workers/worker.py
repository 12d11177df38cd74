"""The gmlx-worker daemon: owns the engine and all MLX state, streams tokens on PUB.

Handshake (docs/protocol.md, "Worker link"): connect a DEALER to the front-end, send
HELLO once the engine is loaded, get WELCOME (worker id, bus name, where to connect the
PUB socket), then publish READY until START arrives: READY is what proves the PUB path is
up, since a PUB socket drops whatever it sends before its subscriber is connected.

The busy loop blocks only when the engine is idle. Between rounds it drains the injection
queue (the DEALER socket) completely, then runs one engine step and publishes ONE message
holding every row's new tokens, each row with a per-request sequence number.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import click
import zmq

from gmlx.config import SERVE_DRAFTER
from ipc import messages as m
from ipc.auth import WorkerCredential, default_secret_path, read_worker_secret, secure_worker_socket
from ipc.bus import RequestBus, StaleSlotError
from ipc.sockets import connect_address
from workers.validate import sampling_params
from workers.watchdog import EXIT_FRONTEND_LOST, Watchdog

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 60.0  # HELLO -> WELCOME -> READY -> START
READY_RESEND_S = 0.05
FRONTEND_TIMEOUT_S = 15.0  # no message from the front-end for this long: it is gone, exit
class Worker:
    """Wraps an engine with the sockets; run() returns the process exit code."""

    def __init__(self, engine, connect_address: str, drafter: str, credential: WorkerCredential | str,
                 is_bus_wanted: bool = True):
        self.engine = engine
        self._secret = credential  # the watchdog's PUB socket authenticates with it too
        self._is_bus_wanted = is_bus_wanted  # False: --no-bus, payloads come inline in INJECT
        self._connect_address = connect_address
        self._drafter = drafter
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 1000)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the front-end reads every round
        self._pub.setsockopt(zmq.LINGER, 1000)
        for sock in (self._dealer, self._pub):  # the front-end refuses workers without the secret
            secure_worker_socket(sock, credential)
        self._bus: RequestBus | None = None
        self.worker_id = -1
        self._heartbeat_interval_s = 0.5
        self._next_seq: dict[str, int] = {}  # live request id -> its next sequence number
        self._pending_outputs: list[m.RowOutput] = []  # rejections waiting for the next publish
        self._num_rounds = 0
        self._last_publish_s = 0.0
        self._last_frontend_s = time.monotonic()
        self._watchdog: Watchdog | None = None
        self.is_stopping = False
        self.is_frontend_lost = False
        self._is_shutdown_received = False  # a SHUTDOWN, not a lost front-end, ended the loop

    # --- handshake ---

    def handshake(self, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        self._dealer.connect(self._connect_address)
        engine = self.engine
        self._send(m.Hello(pid=os.getpid(), model_path=str(engine.model_path),
                           max_context_tokens=int(engine.max_context_tokens), vocab_size=_vocab_size(engine),
                           drafter=self._drafter, has_bus=self._is_bus_wanted))
        welcome = self._wait_for(m.Welcome, deadline_s)
        self.worker_id = welcome.worker_id
        self._heartbeat_interval_s = welcome.heartbeat_interval_s
        if self._is_bus_wanted:
            try:
                self._bus = RequestBus.attach(welcome.bus_name)
            except (OSError, ValueError) as e:  # another host (or another /dev/shm): go inline
                logger.warning("cannot attach the request bus %s (%s): payloads will come inline",
                               welcome.bus_name, e)
        self._pub.connect(connect_address(welcome.pub_address, self._connect_address))
        while True:
            self._publish(m.Ready(worker_id=self.worker_id, has_bus=self._bus is not None))
            try:
                self._wait_for(m.Start, min(deadline_s, time.monotonic() + READY_RESEND_S))
                break
            except TimeoutError:
                if time.monotonic() >= deadline_s:
                    raise
        self._last_frontend_s = time.monotonic()
        monitor = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pub_address = connect_address(welcome.pub_address, self._connect_address)
        self._watchdog = Watchdog(self, pub_address, monitor)
        self._watchdog.start()
        logger.info("worker %d ready (pid %d, model %s)", self.worker_id, os.getpid(), engine.model_path)

    def _wait_for(self, kind: type, deadline_s: float):
        while True:
            timeout_ms = max(0, int((deadline_s - time.monotonic()) * 1000))
            if not self._dealer.poll(timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"no {kind.__name__} from the front-end at {self._connect_address}")
            try:
                msg = m.decode_msgpack(self._dealer.recv_multipart())
            except m.WireError as e:
                logger.warning("dropping an undecodable message during the handshake: %s", e)
                continue
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, m.Shutdown):
                raise SystemExit(0)
            logger.debug("ignoring %s during the handshake", type(msg).__name__)

    # --- busy loop ---

    def run(self) -> int:
        try:
            while not self.is_stopping:
                is_busy = self.engine.has_unfinished()
                self._drain(timeout_ms=0 if is_busy else int(self._heartbeat_interval_s * 1000))
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                if outputs or self._pending_outputs:
                    self._publish_round(outputs)
                self._tick()
            return EXIT_FRONTEND_LOST if self.is_frontend_lost and not self._is_shutdown_received else 0
        except Exception as e:  # a fatal engine error: tell the front-end, then exit
            logger.exception("worker %d failed", self.worker_id)
            self._send_dead(f"{type(e).__name__}: {e}")
            return 1

    def _drain(self, timeout_ms: int) -> None:
        if not self._dealer.poll(timeout_ms, zmq.POLLIN):
            return
        taken_slots = []
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._last_frontend_s = time.monotonic()
            try:
                msg = m.decode_msgpack(frames)
            except m.WireError as e:
                logger.warning("dropping an undecodable message from the front-end: %s", e)
                continue
            if isinstance(msg, m.Inject):
                self._inject(msg, taken_slots)
            elif isinstance(msg, m.Abort):
                self._abort(msg)
            elif isinstance(msg, m.StatsQuery):
                stats = dict(self.engine.stats())
                self._send(m.StatsAnswer(worker_id=self.worker_id, query_id=msg.query_id, stats=stats))
            elif isinstance(msg, m.Shutdown):
                self.is_stopping = self._is_shutdown_received = True
        if taken_slots:
            self._send(m.Taken(worker_id=self.worker_id, slots=taken_slots))

    def _inject(self, msg: m.Inject, taken_slots: list[int]) -> None:
        if msg.payload is not None:  # a worker without the bus: the payload came in the message
            payload = msg.payload
        elif self._bus is None:  # READY said so: the front-end should never do this
            self._reject(msg.request_id, "request payload lost: this worker has no bus and INJECT had no payload")
            return
        else:
            try:
                payload = self._bus.read(msg.slot, msg.generation)
            except StaleSlotError as e:
                self._reject(msg.request_id, f"request payload lost: {e}")
                return
            taken_slots.append(msg.slot)
        try:
            self.engine.add_request(payload.token_ids, sampling_params(payload.sampling), request_id=msg.request_id,
                                    num_generated=payload.num_generated)
        except ValueError as e:  # a bad request ends only itself
            self._reject(msg.request_id, str(e))
            return
        self._next_seq[msg.request_id] = 0

    def _reject(self, request_id: str, error: str) -> None:
        logger.info("request %s rejected: %s", request_id, error)
        self._pending_outputs.append(m.RowOutput(request_id, 0, [], "error", None, error))

    def _abort(self, msg: m.Abort) -> None:
        from gmlx.request import RequestStatus

        if msg.request_id not in self._next_seq:
            return  # already finished: the abort crossed its last output
        if msg.is_stop:  # a normal finish: the engine may offer its prefix to the prompt cache
            self.engine.abort_request(msg.request_id, RequestStatus.FINISHED_STOPPED)
        else:
            self.engine.abort_request(msg.request_id)

    def _publish_round(self, outputs) -> None:
        rows = self._pending_outputs
        self._pending_outputs = []
        # A step may hand one request several outputs (an admission's first token, then the
        # round's); the wire carries one row per request per round.
        merged: dict[str, list] = {}
        for out in outputs:
            row = merged.setdefault(out.request_id, [[], None, None, None, None, None])
            row[0].extend(out.new_token_ids)
            row[1:4] = out.finish_reason, out.stats, None  # the engine fails no request: errors are _reject's
            if out.logprobs is not None:
                row[4] = (row[4] or []) + _wire_logprobs(out.logprobs)
            if out.prompt_logprobs is not None:
                row[5] = _wire_logprobs(out.prompt_logprobs)
        for request_id, (token_ids, finish_reason, stats, error, logprobs, prompt_logprobs) in merged.items():
            if not token_ids and finish_reason is None:
                continue
            if finish_reason is None:
                seq = self._next_seq.get(request_id, 0)
                self._next_seq[request_id] = seq + 1
            else:
                seq = self._next_seq.pop(request_id, 0)
            rows.append(m.RowOutput(request_id, seq, token_ids, finish_reason, stats, error, logprobs,
                                    prompt_logprobs))
        if rows:
            self._num_rounds += 1
            self._publish(m.Round(worker_id=self.worker_id, round_index=self._num_rounds,
                                  emitted_at_ns=time.monotonic_ns(), outputs=rows))

    def _tick(self) -> None:
        now_s = time.monotonic()
        # Heartbeats come from the watchdog thread. Pings wait unread while a step runs; only an empty queue means a silent front-end.
        if now_s - self._last_frontend_s > FRONTEND_TIMEOUT_S and not self._dealer.poll(0, zmq.POLLIN):
            logger.error("no message from the front-end for %.0f s: exiting", FRONTEND_TIMEOUT_S)
            self.is_stopping = True

    # --- sockets ---

    def _send(self, msg: m.Message) -> None:
        self._dealer.send_multipart(m.encode_msgpack(msg))

    def _publish(self, msg: m.Message) -> None:
        self._pub.send_multipart(m.encode_msgpack(msg))
        self._last_publish_s = time.monotonic()

    def _send_dead(self, message: str) -> None:
        dead = m.Dead(worker_id=self.worker_id, message=message)
        try:
            self._publish(dead)
            self._send(dead)
        except zmq.ZMQError:
            logger.exception("could not send DEAD")

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog.join(2.0)
        if self._bus is not None:
            self._bus.close()
        linger_ms = 0 if self.is_frontend_lost else None  # nobody is left to read what is queued
        self._dealer.close(linger=linger_ms)
        self._pub.close(linger=linger_ms)
        self._context.term()


def parse_prefill_budget(value: str | None):
    """--prefill-budget-ms: False (not given), None ('auto'), or seconds (0 = off)."""
    if value is None:
        return False
    if str(value).strip().lower() == "auto":
        return None
    try:
        ms = float(value)
    except ValueError:
        raise click.BadParameter(f"expected 'auto' or milliseconds, got {value!r}") from None
    if not ms >= 0 or ms == float("inf"):
        raise click.BadParameter(f"must be >= 0 milliseconds, got {value!r}")
    return ms / 1000


def _wire_logprobs(entries) -> list:
    """gmlx.logprobs.TokenLogprob entries as the worker link carries them: [logprob, [[id, logprob], ...]]."""
    return [[e.logprob, [list(pair) for pair in e.top]] for e in entries]


def _vocab_size(engine) -> int:
    """The model's vocabulary: token ids must lie below it."""
    target = getattr(engine, "target", None)
    return int(getattr(engine, "vocab_size", None) or getattr(target, "vocab_size", None) or len(engine.tokenizer))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--connect", "connect_address", required=True, help="The front-end's worker address.")
@click.option("--model", "model_path", default=None, help="Model folder (default: the built-in model).")
@click.option("--drafter", default=SERVE_DRAFTER, show_default=True, help="none | mtp | draft[:PATH] | ngram")
@click.option("--speculative-width-cap", type=click.IntRange(min=0), default=None,
              help="Speculate only while at most N rows decode (0 = uncapped).")
@click.option("--prefill-budget-ms", default=None, callback=lambda ctx, param, v: parse_prefill_budget(v),
              help="Prefill time per round while rows decode: 'auto' (2x a decode round), N ms, or 0 (off).")
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False),
              help="Owner-only file with the worker secret (default: where a front-end of this user "
                   "bound at --connect keeps it; the front-end logs the path).")
@click.option("--curve-dir", default=None, type=click.Path(file_okay=False),
              help="Folder with the front-end's server.key and worker.key_secret (from `gmlx keys`): "
                   "authenticate with CURVE, as a front-end with --worker-curve-dir requires.")
@click.option("--no-bus", "is_no_bus", is_flag=True,
              help="Do not use the shared-memory bus (a worker on another host): requests come inline.")
@click.option("--memory-sharers", "num_memory_sharers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Workers sharing this device's memory: without GMLX_KV_CACHE_MB each takes 1/N of the "
                   "default KV budget.")
def main(connect_address: str, model_path: str | None, drafter: str, speculative_width_cap: int | None,
         prefill_budget_ms, secret_file: str | None, curve_dir: str | None, is_no_bus: bool,
         num_memory_sharers: int) -> None:
    """Run one decode worker for a gmlx front-end."""
    from gmlx.config import EngineConfig, log_level

    logging.basicConfig(level=log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [worker %(process)d] %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: _stop_current())
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # the fast BLAS before the engine imports mlx
    from gmlx.engine import Engine

    try:
        if curve_dir is not None:
            credential = WorkerCredential.from_curve_dir(curve_dir)
        else:
            credential = read_worker_secret(secret_file or default_secret_path(connect_address))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--curve-dir" if curve_dir else "--secret-file") from None
    config = EngineConfig(model_path=model_path, drafter=drafter, speculative_width_cap=speculative_width_cap,
                          num_memory_sharers=num_memory_sharers,
                          **({} if prefill_budget_ms is False else {"prefill_budget_s": prefill_budget_ms}))
    try:
        engine = Engine.load(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    worker = Worker(engine, connect_address, drafter, credential, is_bus_wanted=not is_no_bus)
    _CURRENT.append(worker)
    try:
        worker.handshake()
        code = worker.run()
    except TimeoutError as e:
        logger.error("handshake failed: %s", e)
        code = 3
    finally:
        worker.close()
    if worker.is_frontend_lost:  # skip the interpreter's teardown of mlx and transformers (~1 s)
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


_CURRENT: list[Worker] = []


def _stop_current() -> None:
    for worker in _CURRENT:
        worker.is_stopping = True
    if not _CURRENT:
        raise SystemExit(0)


if __name__ == "__main__":
    main()
