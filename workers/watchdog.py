"""The worker's watchdog thread: heartbeats, and noticing that the front-end went away."""

from __future__ import annotations

import logging
import os
import threading

import zmq

from ipc import messages as m
from ipc.auth import secure_worker_socket

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 1.0  # the front-end's connection dropped: the loop gets this long to end a round
EXIT_FRONTEND_LOST = 4  # exit code when the front-end went away


class Watchdog(threading.Thread):
    """Heartbeats and front-end loss, on a thread of their own: decode progress says
    nothing about liveness (a CPU round can take seconds), and a dropped connection to the
    front-end must end the worker within 2 s even mid-round.

    It owns a second PUB socket for the heartbeats and the DEALER's monitor socket (a
    ZeroMQ socket is used by one thread only); mx.eval releases the GIL, so it runs during
    a round."""

    def __init__(self, worker, pub_address: str, monitor: zmq.Socket):
        super().__init__(name="gmlx-watchdog", daemon=True)
        self._worker = worker
        self._pub_address = pub_address
        self._monitor = monitor
        self._is_done = threading.Event()

    def stop(self) -> None:
        self._is_done.set()

    def run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        worker = self._worker
        pub = worker._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        secure_worker_socket(pub, worker._secret)
        pub.connect(self._pub_address)
        interval_ms = max(1, int(worker._heartbeat_interval_s * 1000))
        try:
            while not self._is_done.is_set():
                if self._monitor.poll(interval_ms, zmq.POLLIN):
                    event = recv_monitor_message(self._monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED and not self._is_done.is_set():
                        self._on_frontend_lost()
                        return
                    continue
                heartbeat = m.Heartbeat(worker_id=worker.worker_id, num_unfinished=len(worker._next_seq))
                pub.send_multipart(m.encode_msgpack(heartbeat))
        finally:
            pub.close()
            self._monitor.close()

    def _on_frontend_lost(self) -> None:
        logger.error("worker %d: the front-end's connection dropped; stopping", self._worker.worker_id)
        self._worker.is_stopping = True
        self._worker.is_frontend_lost = True
        if not self._is_done.wait(EXIT_GRACE_S):  # mid-round: nobody will read the result
            logger.error("worker %d: still in a round after %.1f s; exiting now", self._worker.worker_id, EXIT_GRACE_S)
            os._exit(EXIT_FRONTEND_LOST)
