"""The channel to a vLLM engine's tier service (``workers.kv_tiers.TierService``), which lives in
vLLM's worker process: its scheduler process (the connector's lookups) and the replica actor (jobs,
figures) call it here.

A Unix socket in a directory only this user can enter (made by the actor, ``socket_dir``), and
``multiprocessing.connection``'s HMAC challenge with a random key the actor generated and handed to
vLLM in the connector's configuration: no other process can call it. Each call is one message
``(op, kwargs)`` answered by ``("ok", result)`` or ``("error", kind, message)``; only the service's
operations named in ``OPS`` can be called, and the test hooks in ``TEST_OPS`` only on a server built
with ``test_hooks=True``.

The handshake is bounded on both sides: the server accepts raw connections and runs each one's
challenge in its own thread, at most ``max_pending`` at a time (more are closed at once), and shuts
down a connection that has not completed it within ``handshake_timeout`` seconds; a client gives up
on a server that does not complete it within the call's ``timeout``. A silent or hung peer never
holds the accept loop, so it never stalls another client.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

logger = logging.getLogger("strata.vllm.kv_rpc")

OPS = frozenset({"stage", "stage_poll", "staged", "forget", "flush", "probe", "retire", "drop_data_key", "stats",
                 "check_integrity", "drain", "kv_lookup", "kv_retrieve", "kv_store",
                 "events_since", "events_snapshot", "cache_resident", "cache_pin", "cache_drop"})
TEST_OPS = frozenset({"corrupt_l2", "slow_loads"})  # fault injection: served only with test_hooks=True
HANDSHAKE_TIMEOUT_S = 5.0  # a local peer answers in microseconds; a silent one is dropped after this
MAX_PENDING_HANDSHAKES = 16
_CONNECT_TIMEOUT_S = 600.0  # vLLM's worker may take minutes to start on a slow CPU


class TierCallError(RuntimeError):
    """The service refused or failed a call (``kind``: the exception's class name there)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def new_endpoint() -> dict:
    """A fresh ``{"socket", "authkey"}`` for one engine (the directory is 0700)."""
    root = tempfile.mkdtemp(prefix="strata-kv-")
    os.chmod(root, 0o700)
    return {"socket": os.path.join(root, "tiers.sock"), "authkey": secrets.token_hex(32)}


class _Deadline:
    """Shuts ``conn``'s socket down unless ``disarm`` comes within ``seconds``: a read or write blocked
    on it in another thread then fails at once. ``conn`` must stay open until ``disarm`` returns."""

    def __init__(self, conn: Connection, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._armed = True
        self._expired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._armed:
                return
            self._expired = True
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=self._conn.fileno())
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()  # the connection still owns the descriptor

    def disarm(self) -> bool:
        """Stop the clock; ``False`` when it had already run out (the socket is shut down)."""
        self._timer.cancel()
        with self._lock:
            self._armed = False
            return not self._expired


def handshake(conn: Connection, authkey: bytes, *, server: bool, timeout: float) -> None:
    """Run ``multiprocessing.connection``'s mutual HMAC challenge on ``conn`` (the server's side when
    ``server``), all of it within ``timeout`` seconds. Returns with ``conn`` authenticated, or raises
    (``TimeoutError`` past the deadline, ``AuthenticationError`` on a wrong key, another exception on a
    malformed or broken exchange) and leaves ``conn`` for the caller to close."""
    deadline = _Deadline(conn, timeout)
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
    except BaseException:
        if not deadline.disarm():
            raise TimeoutError(f"the peer did not complete the handshake within {timeout:g} s") from None
        raise
    if not deadline.disarm():
        raise TimeoutError(f"the peer did not complete the handshake within {timeout:g} s")


class TierServer:
    """Serves ``target``'s operations on the endpoint, one thread per connection (daemon).

    The operation table is ``OPS``, plus ``TEST_OPS`` when ``test_hooks`` (the test suite only); any
    other name is refused with an error reply. See the module docstring for the handshake's bounds."""

    def __init__(self, target: Any, endpoint: dict, *, test_hooks: bool = False,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S, max_pending: int = MAX_PENDING_HANDSHAKES) -> None:
        self.target = target
        self.ops = OPS | TEST_OPS if test_hooks else OPS
        self.handshake_timeout = handshake_timeout
        self._authkey = bytes.fromhex(endpoint["authkey"])
        self._max_pending = max_pending
        self._pending = threading.BoundedSemaphore(max_pending)
        path = endpoint["socket"]
        if os.path.exists(path):
            os.unlink(path)
        # No authkey here: Listener.accept would run the challenge itself, in the accept loop.
        self._listener = Listener(path, family="AF_UNIX", backlog=max_pending)
        os.chmod(path, 0o600)
        self._closed = False
        threading.Thread(target=self._accept, name="strata-kv-rpc", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:  # the listener closed, or the process is out of descriptors for a moment
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            if not self._pending.acquire(blocking=False):
                logger.warning("refused a connection: %d handshakes already pending", self._max_pending)
                conn.close()
                continue
            try:
                threading.Thread(target=self._admit, args=(conn,), name="strata-kv-rpc-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this one, keep accepting
                self._pending.release()
                conn.close()

    def _admit(self, conn: Connection) -> None:
        try:
            handshake(conn, self._authkey, server=True, timeout=self.handshake_timeout)
        except Exception as exc:  # a silent, slow, unauthenticated or broken peer: drop it
            logger.info("dropped a connection that failed the handshake: %s", type(exc).__name__)
            conn.close()
            return
        finally:
            self._pending.release()
        self._serve(conn)

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", self._call(message))
                except Exception as exc:  # the caller decides; the service keeps serving
                    reply = ("error", type(exc).__name__, str(exc)[:500])
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return

    def _call(self, message: Any) -> Any:
        """``target.op(**kwargs)`` for a message ``(op, kwargs)`` naming an operation of the table."""
        op, kwargs = message
        if op not in self.ops:
            if op in TEST_OPS:
                raise PermissionError(f"{op} is a test hook; this service was started without them")
            raise ValueError(f"unknown operation {op!r}")
        if not isinstance(kwargs, dict):
            raise TypeError("the arguments must be a dict")
        return getattr(self.target, op)(**kwargs)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()


class TierClient:
    """Calls to one service; thread-safe (one call at a time), reconnects after a failure."""

    def __init__(self, endpoint: dict) -> None:
        self._endpoint = endpoint
        self._conn = None
        self._lock = threading.Lock()

    def _connect(self, wait_s: float, timeout: float) -> Connection:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                conn = Client(self._endpoint["socket"], family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        try:
            handshake(conn, bytes.fromhex(self._endpoint["authkey"]), server=False, timeout=timeout)
        except BaseException:
            conn.close()
            raise
        return conn

    def call(self, op: str, *, timeout: float = 60.0, connect_wait: float = _CONNECT_TIMEOUT_S, **kwargs) -> Any:
        """The result of ``op(**kwargs)`` on the service. ``TimeoutError`` when the handshake of a new
        connection, or the answer, did not come in ``timeout`` seconds; ``OSError`` (or
        ``EOFError``) when it cannot be reached in ``connect_wait`` or hung up; ``TierCallError`` when
        it refused or failed the call."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect(connect_wait, timeout)
            try:
                self._conn.send((op, kwargs))
                if not self._conn.poll(timeout):
                    raise TimeoutError(f"the tier service did not answer {op} within {timeout:g} s")
                reply = self._conn.recv()
            except BaseException:
                self._drop()
                raise
        if reply[0] == "ok":
            return reply[1]
        raise TierCallError(reply[1], reply[2])

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
