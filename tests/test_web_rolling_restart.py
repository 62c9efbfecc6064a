"""What a rolling restart of the web tier relies on (docs/upgrades.md, "Rolling restart of web"):
``python -m workers.webserver`` told to stop (SIGTERM, as ``docker stop`` and Kubernetes send it)
closes its listener at once, so a new connection is refused and goes to another process, and lets a
response already in flight finish, within ``--timeout-graceful-shutdown`` seconds; a response that
needs longer is cut at that bound (the paired case: the flag is what decides).

The real server (``webserver.uvicorn_config``: the guarded protocol, the connection cap) in its own
process with a real SIGTERM, around :func:`slow_app`, which streams ``?chunks=N`` chunks 0.2 s apart.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP_S = 0.2


async def slow_app(scope, receive, send):
    if scope["type"] != "http":
        return
    chunks = int(parse_qs(scope["query_string"].decode()).get("chunks", ["5"])[0])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(chunks):
        await send({"type": "http.response.body", "body": f"chunk {i}\n".encode(), "more_body": True})
        await asyncio.sleep(STEP_S)
    await send({"type": "http.response.body", "body": b"done\n"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, graceful_s: int) -> subprocess.Popen:
    code = ("import uvicorn; from workers import webserver; "
            f"args = webserver.parse_args(['--port', '{port}', '--timeout-graceful-shutdown', '{graceful_s}']); "
            "uvicorn.Server(webserver.uvicorn_config(args, app='tests.test_web_rolling_restart:slow_app')).run()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the web server did not start")


def _stream_through_sigterm(graceful_s: int, chunks: int) -> tuple[bytes | None, Exception | None, Exception]:
    """Start a ``chunks``-long stream, SIGTERM the server once its first chunk arrived, try a new
    connection, then read the rest. Returns (body or None, the read's error, the new connection's error)."""
    port = _free_port()
    proc = _start(port, graceful_s)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", f"/stream?chunks={chunks}")
        response = conn.getresponse()
        first = response.readline()
        assert first == b"chunk 0\n"
        proc.send_signal(signal.SIGTERM)
        refused: Exception = AssertionError("new connections were still accepted 5 s after SIGTERM")
        deadline = time.monotonic() + 5  # the listener closes at the server's next tick (0.1 s)
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError as exc:
                refused = exc
                break
            time.sleep(0.05)
        try:
            return first + response.read(), None, refused
        except (http.client.IncompleteRead, ConnectionError) as exc:
            return None, exc, refused
    finally:
        try:
            proc.wait(timeout=graceful_s + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_sigterm_finishes_the_response_in_flight_and_refuses_new_connections():
    body, error, refused = _stream_through_sigterm(graceful_s=10, chunks=10)  # a 2 s stream
    assert error is None and body is not None
    assert body.splitlines() == [f"chunk {i}".encode() for i in range(10)] + [b"done"]
    assert isinstance(refused, ConnectionRefusedError), refused


def test_a_response_longer_than_the_graceful_timeout_is_cut():
    body, error, refused = _stream_through_sigterm(graceful_s=1, chunks=25)  # a 5 s stream, 1 s of grace
    assert body is None and error is not None
    assert isinstance(refused, ConnectionRefusedError), refused
