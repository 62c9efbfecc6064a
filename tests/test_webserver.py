"""The web server as ``make run`` starts it (``workers.launcher.web_argv`` -> ``workers.webserver``):
half-sent request lines and silent connections are closed after the header timeout, a trickled body
is answered 408, complete requests are served, the client address is the TCP peer whatever
``X-Forwarded-For`` says, and past the connection cap uvicorn answers 503.

A real uvicorn on a free port, with short timeouts; assertions are on what the socket sees (closed,
a status line), never on how long it took. The last test runs the real process and app."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workers import launcher, webserver

REPO = Path(__file__).resolve().parents[1]
SAFETY_S = 60  # a socket read that outlives this means the server kept the connection: the test fails


async def echo_app(scope, receive, send):
    """Reads the whole body, answers the client address and the body length."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"client": scope["client"][0], "size": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(request):
    """uvicorn with the flags ``make run`` passes (limits from ``STRATA_WEB_*``) around ``echo_app``.
    Parametrised with the ``STRATA_WEB_*`` values to change; by default one source may hold the whole
    cap, so that the timeouts are what the tests see."""
    environ = {**os.environ, "STRATA_WEB_HEADER_TIMEOUT_S": "0.5", "STRATA_WEB_BODY_TIMEOUT_S": "0.5",
               "STRATA_WEB_MAX_CONNECTIONS": "64", **getattr(request, "param", {})}
    environ.setdefault("STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE", environ["STRATA_WEB_MAX_CONNECTIONS"])
    argv = launcher.web_argv(sys.executable, free_port(), environ)
    assert argv[1:3] == ["-m", "workers.webserver"]
    args = webserver.parse_args(argv[3:])
    import uvicorn

    srv = uvicorn.Server(webserver.uvicorn_config(args, app=echo_app))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(600):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    yield args.port
    srv.should_exit = True
    thread.join(timeout=10)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the server from ``source`` (any 127.0.0.0/8 address: Linux routes them all to
    the loopback interface, so each is a distinct client address to the server)."""
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    sock.settimeout(SAFETY_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_make_run_passes_limits_and_no_proxy_header_trust():
    argv = launcher.web_argv("python", 8000, {"STRATA_WEB_MAX_CONNECTIONS": "100", "FORWARDED_ALLOW_IPS": "*"})
    for flag, value in (("--limit-concurrency", "100"), ("--max-connections-per-source", "25"),
                        ("--timeout-keep-alive", "5"), ("--timeout-header", "10"), ("--timeout-body", "60")):
        assert argv[argv.index(flag) + 1] == value
    assert "--proxy-headers" not in argv and "--forwarded-allow-ips" not in argv
    config = webserver.uvicorn_config(webserver.parse_args(argv[3:]))
    assert config.proxy_headers is False and config.limit_concurrency == 100
    assert config.http.shares.per_source == 25


def test_half_sent_request_lines_and_silent_connections_are_closed_and_free_their_slots(server):
    socks = [connect(server, f"127.0.0.{1 + i % 2}") for i in range(100)]  # more than the cap (64), two sources
    for i, sock in enumerate(socks):
        if i % 2:
            sock.sendall(b"GET /healthz HT")  # half a request line, never finished
    assert [read_all(sock) for sock in socks] == [b""] * 100  # closed, nothing answered
    for sock in socks:
        sock.close()
    with connect(server) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("flag", ["--timeout-header", "--timeout-body", "--limit-concurrency"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_limits_must_be_positive(flag, value):
    if value == "nan" and flag == "--limit-concurrency":
        value = "x"
    with pytest.raises(SystemExit):
        webserver.parse_args([flag, value])


def test_trickled_headers_are_closed_even_though_bytes_keep_coming(server):
    with connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        sock.settimeout(0.2)
        closed = False
        for _ in range(300):  # one header byte at a time, a bounded number of times
            try:
                sock.sendall(b"X")
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed


def test_a_trickled_body_is_answered_408_and_the_connection_closed(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        sock.settimeout(0.2)
        answer = b""
        for _ in range(300):
            try:
                sock.sendall(b" ")
                answer = sock.recv(65536)
                break
            except TimeoutError:
                continue
        sock.settimeout(SAFETY_S)
        answer += read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "body_timeout"


def test_complete_requests_are_served_and_the_client_is_the_tcp_peer(server):
    with connect(server) as sock:
        for _ in range(2):  # kept alive between the two
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 6.6.6.6\r\nContent-Length: 3\r\n\r\nabc")
            head = b""
            while b"}" not in head:
                head += sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 200")
            assert json.loads(head.partition(b"\r\n\r\n")[2]) == {"client": "127.0.0.1", "size": 3}
        sock.sendall(b"GET /x HTT")  # the next request on the kept-alive connection stalls
        assert read_all(sock) == b""


@pytest.mark.parametrize("server", [{"STRATA_WEB_MAX_CONNECTIONS": "2"}], indirect=True)
def test_past_the_connection_cap_new_requests_get_503(server):
    with connect(server) as held:
        held.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1 100")  # admitted: the app waits for its body
        with connect(server) as extra:  # connected only now, so the held request was admitted alone
            extra.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            extra.settimeout(SAFETY_S)
            head, _, body = read_all(extra).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
            assert json.loads(body)["error"]["code"] == "over_capacity"


# ------------------------------------------------------------------ each source's share of the cap
HELD = {"STRATA_WEB_HEADER_TIMEOUT_S": "60", "STRATA_WEB_BODY_TIMEOUT_S": "60"}  # held requests stay held
HALF_SENT = b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n"


def first_answer(sock: socket.socket) -> bytes:
    """The first response head (and body, when the server closes after it); b"" for a reset."""
    data = b""
    try:
        while b"\r\n\r\n" not in data or data.startswith((b"HTTP/1.1 4", b"HTTP/1.1 5")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return data


def hold(port: int, source: str, count: int) -> tuple[list[socket.socket], list[bytes]]:
    """``count`` half-sent requests from ``source``: headers sent, body never; each admitted one is
    answered ``100 Continue`` by the server (proof that it holds a slot), each refused one is not."""
    socks, answers = [], []
    for _ in range(count):
        sock = connect(port, source)
        with contextlib.suppress(OSError):  # a refused connection may already be closed
            sock.sendall(HALF_SENT)
        socks.append(sock)
        answers.append(first_answer(sock))
    return socks, answers


def get(port: int, path: str, source: str = "127.0.0.1", extra: bytes = b"") -> bytes:
    with connect(port, source) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n" % (path.encode(), extra))
        return read_all(sock)


@pytest.mark.parametrize("server", [{"STRATA_WEB_MAX_CONNECTIONS": "8", "STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE": "3",
                                     **HELD}], indirect=True)
def test_one_source_past_its_share_gets_429_while_other_clients_and_healthz_are_served(server):
    socks, answers = hold(server, "127.0.0.2", 10)  # more than the whole cap (8), from one address
    try:
        held = [a for a in answers if a.startswith(b"HTTP/1.1 100")]
        refused = [a for a in answers if not a.startswith(b"HTTP/1.1 100")]
        assert len(held) == 3 and len(refused) == 7  # its share, and not one slot more
        for answer in refused:  # answered at once (or reset when its request crossed the answer)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert get(server, "/x").startswith(b"HTTP/1.1 200")  # another client is served
        assert get(server, "/healthz").startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("server", [{"STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE": "2", **HELD}], indirect=True)
def test_the_connection_past_the_share_is_answered_429_in_the_json_shape_before_it_sends(server):
    socks, answers = hold(server, "127.0.0.2", 2)
    try:
        assert all(a.startswith(b"HTTP/1.1 100") for a in answers)
        with connect(server, "127.0.0.2") as extra:  # sends nothing: the answer comes unasked
            head, _, body = read_all(extra).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower()
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for sock in socks:
            sock.close()
    # Its closed connections gave the slots back.
    assert get(server, "/x", "127.0.0.2").startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("server", [{"STRATA_WEB_MAX_CONNECTIONS": "5", "STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE": "2",
                                     **HELD}], indirect=True)
def test_health_checks_are_answered_while_several_sources_fill_the_cap(server):
    socks: list[socket.socket] = []
    try:
        # Two sources, two slots each: with the next connection the server is at its cap (5).
        for source in ("127.0.0.2", "127.0.0.3"):
            held, answers = hold(server, source, 2)
            socks += held
            assert all(a.startswith(b"HTTP/1.1 100") for a in answers)
        ordinary = get(server, "/x")
        assert ordinary.startswith(b"HTTP/1.1 503")  # the cap still holds for everything else...
        assert json.loads(ordinary.partition(b"\r\n\r\n")[2])["error"]["code"] == "over_capacity"
        assert get(server, "/healthz").startswith(b"HTTP/1.1 200")  # ... but not for health checks
        assert get(server, "/readyz").startswith(b"HTTP/1.1 200")
        # A health path with a body could be held open: no reserve for it.
        assert get(server, "/healthz", extra=b"Content-Length: 1\r\n").startswith(b"HTTP/1.1 503")
    finally:
        for sock in socks:
            sock.close()


def test_the_real_web_process_closes_half_sent_lines_and_answers_trickled_bodies_408(tmp_path):
    port = free_port()
    env = {**os.environ, "STRATA_HOME": str(tmp_path), "STRATA_WEB_HEADER_TIMEOUT_S": "1",
           "STRATA_WEB_BODY_TIMEOUT_S": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    proc = subprocess.Popen(launcher.web_argv(sys.executable, port, env), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(1200):
            if launcher.port_open("127.0.0.1", port):
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        with connect(port) as half:
            half.sendall(b"GET /healthz HT")
            assert read_all(half) == b""
        with connect(port) as slow:
            # No key: the serving gate looks keys up in the database, which this process never migrated.
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            answer = read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
