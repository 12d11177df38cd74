"""Socket set-up shared by the front-end and the worker (pyzmq only, no mlx)."""

from __future__ import annotations

import zmq

from ipc import messages as m

HWM_MESSAGES = 100_000  # per peer; far above what a healthy peer ever queues


def bind_router(ctx: zmq.Context, address: str, max_frame_bytes: int = m.MAX_FRAME_BYTES,
                secure=None) -> zmq.Socket:
    """A ROUTER bound at `address`; ValueError naming the address if it cannot bind.
    `secure(sock)` sets its security mechanism, which must precede the bind."""
    sock = ctx.socket(zmq.ROUTER)
    if secure is not None:
        secure(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises instead of vanishing
    sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # bigger frames drop the connection
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close()
        raise ValueError(f"cannot bind {address}: {e}") from None
    return sock


def bind_sub_beside(ctx: zmq.Context, endpoint: str, secure=None) -> zmq.Socket:
    """A SUB socket bound next to `endpoint` (same host, any free port) taking every topic."""
    sock = ctx.socket(zmq.SUB)
    if secure is not None:
        secure(sock)
    sock.setsockopt(zmq.RCVHWM, 0)  # never drop a round: gaps would fail requests
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint.rsplit(":", 1)[0] + ":*" if endpoint.startswith("tcp://") else endpoint + ".rounds")
    return sock


def recv_all(sock: zmq.Socket):
    """Every message already queued on `sock`, without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def recv_all_bounded(sock: zmq.Socket, max_parts: int):
    """Like recv_all, but parts past the first max_parts are dropped uncopied (a message's
    parts arrive together, so a many-part message is never held twice in memory); such a
    message comes out with max_parts + 1 parts, the last one empty, so it still fails to decode."""
    while True:
        try:
            parts = [sock.recv(zmq.NOBLOCK)]
        except zmq.Again:
            return
        is_truncated = False
        while sock.getsockopt(zmq.RCVMORE):
            frame = sock.recv(copy=False)
            if len(parts) < max_parts:
                parts.append(frame.bytes)
            else:
                is_truncated = True
        yield parts + [b""] if is_truncated else parts


def connect_address(bound: str, connect_address: str) -> str:
    """Where a peer reaches `bound` (a wildcard-host bind) given the address it already used."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if bound.startswith(wildcard) and connect_address.startswith("tcp://"):
            host = connect_address[len("tcp://"):].rsplit(":", 1)[0]
            return f"tcp://{host}:{bound[len(wildcard):]}"
    return bound
