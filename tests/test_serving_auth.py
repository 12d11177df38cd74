"""Security on a live `gmlx serve`: a non-loopback address needs CURVE keys, clients without
an authorized key are refused, forged workers are refused, the bus is owner-only."""

import os
import shutil
import stat
import subprocess
import sys

import pytest
import zmq
from click.testing import CliRunner

from ipc import messages as m
from ipc.auth import secure_worker_socket
from ipc.bus import SHM_DIR, list_segments, parse_owner
from ipc.client import Client, RequestError
from serving_support import REPO_ROOT, Server, free_port, model_dir, repo_env

TEST_TIMEOUT_S = 150



def make_keys(folder) -> str:
    from workers.cli import main

    result = CliRunner().invoke(main, ["keys", str(folder)])
    assert result.exit_code == 0, result.output
    return str(folder)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("auth") / "keys")


@pytest.fixture(scope="module")
def server(keys):
    port, worker_port = free_port(), free_port()
    srv = Server("--address", f"tcp://0.0.0.0:{port}", "--curve-dir", keys,
                 "--worker-address", f"tcp://127.0.0.1:{worker_port}", model=model_dir(), drafter="none")
    srv.client_address = f"tcp://127.0.0.1:{port}"
    srv.worker_address = f"tcp://127.0.0.1:{worker_port}"
    yield srv
    srv.kill()


def test_binding_all_interfaces_without_keys_is_refused():
    cmd = [sys.executable, "-m", "workers.cli_serve", "--address", f"tcp://0.0.0.0:{free_port()}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 2
    assert "gmlx keys" in out.stderr and "--curve-dir" in out.stderr and "--insecure" in out.stderr


def test_key_files_are_owner_only(keys):
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(os.path.join(keys, name)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700


def test_an_authorized_client_is_served(server, keys):
    with Client(server.client_address, timeout_s=60, curve_dir=keys) as client:
        chunks = list(client.generate(token_ids=[1, 2, 3], max_tokens=4))
    assert chunks[-1].finish_reason == "length"


def test_clients_without_an_authorized_key_are_refused(server, keys, tmp_path):
    with Client(server.client_address, timeout_s=3) as client:  # no CURVE at all
        with pytest.raises((TimeoutError, RequestError)):
            list(client.generate(token_ids=[1, 2, 3], max_tokens=4))
    stranger = make_keys(tmp_path / "stranger")  # a key pair the server never authorized
    shutil.copy(os.path.join(keys, "server.key"), os.path.join(stranger, "server.key"))
    with Client(server.client_address, timeout_s=3, curve_dir=stranger) as client:
        with pytest.raises((TimeoutError, RequestError)):
            list(client.generate(token_ids=[1, 2, 3], max_tokens=4))


@pytest.mark.parametrize("secret", [None, "a-wrong-secret-of-some-length"])
def test_a_forged_worker_is_refused(server, keys, secret):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure_worker_socket(sock, secret)
    sock.connect(server.worker_address)
    sock.send_multipart(m.encode_msgpack(m.Hello(pid=os.getpid(), model_path=str(model_dir()),
                                                 max_context_tokens=64, vocab_size=64, drafter="none")))
    assert not sock.poll(3000), "a worker without the secret got an answer"
    sock.close()
    with Client(server.client_address, timeout_s=60, curve_dir=keys) as client:
        assert client.stats()["num_workers"] == 1


def test_the_bus_is_owner_only(server):
    [name] = [n for n in list_segments() if parse_owner(n)[0] == server.first_frontend_pid]
    assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600
