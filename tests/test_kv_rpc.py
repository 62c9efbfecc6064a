"""The vLLM tier service's RPC (``workers.kv_rpc``, issue 42 item 10), against the real classes over a
real Unix socket: a silent local connection neither stalls other clients nor lives past the handshake
deadline, pending handshakes are bounded, a client gives up on a silent server, and the fault-injection
operations are served only by a server built with ``test_hooks=True``."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, Listener

import pytest

from workers.kv_rpc import OPS, TEST_OPS, TierCallError, TierClient, TierServer, new_endpoint

WAIT_S = 30.0  # generous: only ever reached when the defence under test is missing


class Target:
    """A stand-in tier service: records which operations ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def stats(self) -> dict:
        self.ran.append("stats")
        return {"blocks": 7}

    def slow_loads(self, seconds: float) -> None:
        self.ran.append("slow_loads")

    def corrupt_l2(self, hashes: list[bytes]) -> int:
        self.ran.append("corrupt_l2")
        return len(hashes)


@pytest.fixture
def endpoint():
    ep = new_endpoint()
    yield ep
    shutil.rmtree(ep["socket"].rsplit("/", 1)[0], ignore_errors=True)


@pytest.fixture
def serve(endpoint):
    """``serve(**server_kwargs)`` -> (server, target) on ``endpoint``; closed after the test."""
    servers = []

    def make(**kwargs):
        target = Target()
        server = TierServer(target, endpoint, **kwargs)
        servers.append(server)
        return server, target

    yield make
    for s in servers:
        s.close()


def silent_socket(endpoint) -> socket.socket:
    """A raw connection that reads the server's challenge, then never answers it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT_S)
    sock.connect(endpoint["socket"])
    assert sock.recv(1024), "the server sends its challenge first"
    return sock


def call_in_thread(client: TierClient, op: str, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``client.call`` in a thread so that a missing defence fails the test instead of hanging it."""
    out: dict = {}

    def run():
        try:
            out["result"] = client.call(op, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (read to the end); ``False`` when it stayed open ``WAIT_S``."""
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_silent_connection_does_not_stall_a_real_client(serve, endpoint):
    # The deadline is far away: the client gets through because handshakes run beside the accept loop.
    serve(handshake_timeout=120.0)
    silent = silent_socket(endpoint)
    client = TierClient(endpoint)
    try:
        t, out = call_in_thread(client, "stats", timeout=WAIT_S, connect_wait=WAIT_S)
        t.join(WAIT_S + 5)
        assert not t.is_alive()
        assert out.get("result") == {"blocks": 7}, out
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}  # and keeps being served
    finally:
        client.close()
        silent.close()


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(serve, endpoint):
    serve(handshake_timeout=0.3)
    silent = silent_socket(endpoint)
    client = TierClient(endpoint)
    try:
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}
        assert closed_by_peer(silent)
        # An authenticated connection is not: it is still served after the deadline has passed.
        time.sleep(1.0)
        conn = client._conn
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}
        assert client._conn is conn
    finally:
        client.close()
        silent.close()


def test_pending_handshakes_are_bounded_and_their_slots_come_back(serve, endpoint):
    serve(handshake_timeout=120.0, max_pending=2)
    first, second = silent_socket(endpoint), silent_socket(endpoint)
    extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    extra.settimeout(WAIT_S)
    extra.connect(endpoint["socket"])
    try:
        assert closed_by_peer(extra)  # closed at once: no challenge, no thread
        first.close()
        second.close()  # their handshakes fail and free the slots, once their threads see the close
        deadline = time.monotonic() + WAIT_S
        while True:
            client = TierClient(endpoint)
            try:
                assert client.call("stats", timeout=WAIT_S, connect_wait=WAIT_S) == {"blocks": 7}
                break
            except EOFError:  # refused: a closed handshake's thread had not given its slot back yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                client.close()
    finally:
        extra.close()
        first.close()
        second.close()


def test_a_client_gives_up_on_a_server_that_never_sends_its_challenge(endpoint):
    listener = Listener(endpoint["socket"], family="AF_UNIX")  # accepts, never authenticates
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    client = TierClient(endpoint)
    t, out = call_in_thread(client, "stats", timeout=0.3, connect_wait=WAIT_S)
    try:
        t.join(WAIT_S)
        assert not t.is_alive()
        assert isinstance(out.get("error"), TimeoutError), out
        assert client._conn is None  # the next call reconnects
    finally:
        for conn in accepted:  # first: a client still blocked on it then sees the end and lets go
            conn.close()
        listener.close()
        t.join(WAIT_S)
        client.close()


def test_a_wrong_key_is_refused_and_the_right_one_served(serve, endpoint):
    serve()
    intruder = TierClient({**endpoint, "authkey": "00" * 32})
    with pytest.raises(AuthenticationError):
        intruder.call("stats", timeout=WAIT_S)
    client = TierClient(endpoint)
    try:
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}
    finally:
        client.close()


def test_the_production_table_lacks_the_test_hooks():
    assert {"corrupt_l2", "slow_loads"} <= TEST_OPS
    assert not OPS & TEST_OPS


def test_a_production_server_refuses_the_test_hooks(serve, endpoint):
    server, target = serve()
    assert not server.ops & TEST_OPS
    client = TierClient(endpoint)
    try:
        for op, kwargs in (("slow_loads", {"seconds": 2.0}), ("corrupt_l2", {"hashes": [b"h"]})):
            with pytest.raises(TierCallError) as err:
                client.call(op, timeout=WAIT_S, **kwargs)
            assert err.value.kind == "PermissionError"
        assert target.ran == []
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}  # the connection still serves
    finally:
        client.close()


def test_a_test_server_serves_the_test_hooks(serve, endpoint):
    _, target = serve(test_hooks=True)
    client = TierClient(endpoint)
    try:
        client.call("slow_loads", timeout=WAIT_S, seconds=2.0)
        assert client.call("corrupt_l2", timeout=WAIT_S, hashes=[b"a", b"b"]) == 2
        assert target.ran == ["slow_loads", "corrupt_l2"]
    finally:
        client.close()


def test_unknown_operations_and_malformed_messages_are_refused(serve, endpoint):
    _, target = serve()
    client = TierClient(endpoint)
    try:
        with pytest.raises(TierCallError) as err:
            client.call("__init__", timeout=WAIT_S)
        assert err.value.kind == "ValueError"
        client.call("stats", timeout=WAIT_S)
        client._conn.send("not a pair")  # an authenticated peer's bad message: an error reply
        assert client._conn.recv()[0] == "error"
        assert client.call("stats", timeout=WAIT_S) == {"blocks": 7}
    finally:
        client.close()
