"""Authentication with ZeroMQ's own mechanisms (pyzmq only, no mlx).

Client link: CURVE, required when the client address is not loopback. `gmlx keys DIR`
writes a server key pair, a client key pair, and DIR/authorized_clients/ holding the public
keys the server accepts. The server needs DIR (its secret key and authorized_clients/);
a client needs server.key and its own client.key_secret.

Worker link, on loopback: ZeroMQ PLAIN with a random shared secret kept in a file only the
owner can read; the front-end's ZAP handler refuses any worker (DEALER or PUB) without it.
PLAIN sends the secret in clear, which is fine only while the link never leaves the host.
Worker link off loopback (workers on other hosts): CURVE, required. `gmlx keys DIR` also
writes a worker key pair and DIR/authorized_workers/; a worker needs server.key and
worker.key_secret, so a client key cannot join as a worker.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

WORKER_USERNAME = "gmlx-worker"
AUTHORIZED_DIR = "authorized_clients"
AUTHORIZED_WORKERS_DIR = "authorized_workers"
SECRET_BYTES = 32


def is_loopback(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: may be reachable from outside


def make_keys(folder: str | Path) -> Path:
    """Write server and client CURVE key pairs into `folder` (created owner-only)."""
    folder = Path(folder).expanduser()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for name in ("server", "client", "worker"):
        if (folder / f"{name}.key_secret").exists():
            raise ValueError(f"{folder / (name + '.key_secret')} exists; remove it to make new keys")
    for name in ("server", "client", "worker"):
        zmq.auth.create_certificates(str(folder), name)
        os.chmod(folder / f"{name}.key_secret", 0o600)
    for subdir, name in ((AUTHORIZED_DIR, "client"), (AUTHORIZED_WORKERS_DIR, "worker")):
        authorized = folder / subdir
        authorized.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(folder / f"{name}.key", authorized / f"{name}.key")
    return folder


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")


def _load_server_keys(folder: Path, authorized: str, option: str) -> tuple[bytes, bytes]:
    secret_path = folder / "server.key_secret"
    if not secret_path.is_file() or not (folder / authorized).is_dir():
        raise ValueError(f"{option} {folder}: no server.key_secret or {authorized}/ "
                         "(make them with `gmlx keys DIR`)")
    _check_private(secret_path)
    return zmq.auth.load_certificate(str(secret_path))


class ServerAuth:
    """The front-end's ZAP handler: CURVE for clients (when keys are given); for workers,
    CURVE when worker keys are given (required off loopback), else PLAIN with the secret."""

    def __init__(self, ctx: zmq.Context, curve_dir: str | Path | None, worker_curve_dir: str | Path | None = None):
        self._authenticator = ThreadAuthenticator(ctx)
        self._authenticator.start()
        self._authenticator.configure_plain(domain="workers", passwords={})  # nobody until allow_workers
        self._curve = None
        if curve_dir is not None:
            folder = Path(curve_dir).expanduser()
            self._curve = _load_server_keys(folder, AUTHORIZED_DIR, "--curve-dir")
            self._authenticator.configure_curve(domain="clients", location=str(folder / AUTHORIZED_DIR))
        self._worker_curve = None
        if worker_curve_dir is not None:
            folder = Path(worker_curve_dir).expanduser()
            self._worker_curve = _load_server_keys(folder, AUTHORIZED_WORKERS_DIR, "--worker-curve-dir")
            self._authenticator.configure_curve(domain="workers", location=str(folder / AUTHORIZED_WORKERS_DIR))

    @property
    def is_worker_curve(self) -> bool:
        return self._worker_curve is not None

    def allow_workers(self, worker_secret: str) -> None:
        self._authenticator.configure_plain(domain="workers", passwords={WORKER_USERNAME: worker_secret})

    def secure_clients(self, sock: zmq.Socket) -> None:
        if self._curve is not None:
            public, secret = self._curve
            sock.setsockopt_string(zmq.ZAP_DOMAIN, "clients")
            sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True

    def secure_workers(self, sock: zmq.Socket) -> None:
        sock.setsockopt_string(zmq.ZAP_DOMAIN, "workers")
        if self._worker_curve is not None:
            public, secret = self._worker_curve
            sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
        else:
            sock.plain_server = True

    def stop(self) -> None:
        self._authenticator.stop()


def secure_client_socket(sock: zmq.Socket, curve_dir: str | Path) -> None:
    """Set a client socket up for a CURVE server: DIR holds server.key and client.key_secret."""
    folder = Path(curve_dir).expanduser()
    server_public, _ = zmq.auth.load_certificate(str(folder / "server.key"))
    public, secret = zmq.auth.load_certificate(str(folder / "client.key_secret"))
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret


@dataclass(frozen=True)
class WorkerCredential:
    """How a worker proves itself: the PLAIN secret (same host) or CURVE keys (any host)."""

    secret: str | None = None
    curve_dir: Path | None = None  # holds server.key and worker.key_secret

    def __post_init__(self):
        assert (self.secret is None) != (self.curve_dir is None), "exactly one of secret, curve_dir"

    @classmethod
    def from_curve_dir(cls, curve_dir: str | Path) -> "WorkerCredential":
        """ValueError naming the folder if it lacks the worker's keys."""
        folder = Path(curve_dir).expanduser()
        for name in ("server.key", "worker.key_secret"):
            if not (folder / name).is_file():
                raise ValueError(f"{folder}: no {name} (copy it from the `gmlx keys` folder of the front-end)")
        _check_private(folder / "worker.key_secret")
        return cls(curve_dir=folder)


def secure_worker_socket(sock: zmq.Socket, credential: "WorkerCredential | str") -> None:
    """Set a worker's DEALER or PUB up; a str is the PLAIN secret."""
    if isinstance(credential, str):
        credential = WorkerCredential(secret=credential)
    if credential.curve_dir is not None:
        server_public, _ = zmq.auth.load_certificate(str(credential.curve_dir / "server.key"))
        public, secret = zmq.auth.load_certificate(str(credential.curve_dir / "worker.key_secret"))
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    else:
        sock.plain_username = WORKER_USERNAME.encode()
        sock.plain_password = credential.secret.encode()


def default_secret_path(worker_address: str) -> Path:
    """Where a front-end bound at `worker_address` keeps its worker secret, so that
    `gmlx-worker --connect ADDR` run by the same user finds it without --secret-file."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"gmlx-{os.getuid()}"
    if worker_address.startswith("tcp://"):
        name = "tcp-" + worker_address.rsplit(":", 1)[1]  # one listener per port, whatever host it was reached by
    else:
        name = "".join(c if c.isalnum() else "-" for c in worker_address)
    return base / f"worker-{name}.secret"


def write_worker_secret(path: Path) -> str:
    """A fresh secret in a new owner-only file at `path` (its folder must be ours, 0700)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    info = path.parent.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ValueError(f"{path.parent} is not a private folder of this user: refusing to keep a secret there")
    secret = secrets.token_hex(SECRET_BYTES)
    path.unlink(missing_ok=True)  # a stale one from a front-end that died on this port
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def read_worker_secret(path: str | Path) -> str:
    """The secret in an owner-only file; ValueError naming the file otherwise."""
    path = Path(path).expanduser()
    try:
        _check_private(path)
        secret = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"worker secret file {path}: {e}") from None
    if len(secret) < 16:
        raise ValueError(f"worker secret file {path}: the secret is shorter than 16 characters")
    return secret


def insecure_bind_message(address: str) -> str:
    return (f"refusing to serve {address} without authentication: it is not a loopback address. "
            "Make CURVE keys with `gmlx keys DIR` and pass --curve-dir DIR (clients use the same DIR), "
            "or pass --insecure to serve it unauthenticated")


def insecure_worker_bind_message(worker_address: str) -> str:
    return (f"refusing to let workers connect at {worker_address} without CURVE: it is not a loopback "
            "address, and the worker secret would cross the network in clear. Make keys with `gmlx keys DIR` "
            "and pass --worker-curve-dir DIR (each worker: gmlx-worker --curve-dir DIR, holding DIR's "
            "server.key and worker.key_secret)")
