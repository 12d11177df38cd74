"""The HTTP gateway's settings and the parsing of what `gmlx serve` and the gateway's own
command line pass it (no starlette here, so `gmlx serve` checks its options cheaply)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

BUILTIN_MODEL_ID = "gmlx-builtin"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    server_address: str  # the front-end's client address (tcp://...)
    host: str = "127.0.0.1"
    port: int = 8000
    model_path: str | None = None  # None = the built-in model; its tokenizer renders chat messages
    model_id: str = BUILTIN_MODEL_ID  # the name /v1/models lists and requests must use
    api_key: str | None = None  # bearer token; required when host is not loopback
    timeout_s: float = 60.0  # longest wait for any one reply of the front-end

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--http: port must be in 1..65535, got {self.port}")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"--http: binding {self.host} (not loopback) needs a bearer token: pass "
                             "--http-api-key-file FILE or set GMLX_HTTP_API_KEY")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def parse_http_url(url: str) -> tuple[str, int]:
    """`http://HOST:PORT` -> (host, port); ValueError naming the bad value."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--http: expected http://HOST:PORT, got {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"--http: bad port in {url!r}") from None
    return parts.hostname, port


def model_id_for(model_path: str | None) -> str:
    return BUILTIN_MODEL_ID if model_path is None else os.path.basename(os.path.normpath(model_path))


def read_api_key(api_key_file: str | None) -> str | None:
    """The bearer token from a file (first line), else GMLX_HTTP_API_KEY, else None."""
    from gmlx.config import http_api_key

    if api_key_file is None:
        return http_api_key()
    try:
        with open(os.path.expanduser(api_key_file)) as f:
            key = f.readline().strip()
    except OSError as e:
        raise ValueError(f"--http-api-key-file: {e}") from None
    if not key:
        raise ValueError(f"--http-api-key-file: {api_key_file} is empty")
    return key
