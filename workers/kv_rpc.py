"""The channel to a vLLM engine's tier service (``workers.kv_tiers.TierService``), which lives in
vLLM's worker process: its scheduler process (the connector's lookups) and the replica actor (jobs,
figures) call it here.

A Unix socket in a directory only this user can enter (made by the actor, ``socket_dir``), and
``multiprocessing.connection``'s HMAC challenge with a random key the actor generated and handed to
vLLM in the connector's configuration: no other process can call it. Each call is one message
``(op, kwargs)`` answered by ``("ok", result)`` or ``("error", kind, message)``; only the service's
operations named in ``OPS`` can be called.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any

logger = logging.getLogger("strata.vllm.kv_rpc")

OPS = frozenset({"stage", "stage_poll", "staged", "forget", "flush", "probe", "retire", "drop_data_key", "stats",
                 "check_integrity", "drain", "kv_lookup", "kv_retrieve", "kv_store", "corrupt_l2", "slow_loads",
                 "events_since", "events_snapshot", "cache_resident", "cache_pin", "cache_drop"})
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


class TierServer:
    """Serves ``target``'s operations on the endpoint, one thread per connection (daemon)."""

    def __init__(self, target: Any, endpoint: dict) -> None:
        self.target = target
        path = endpoint["socket"]
        if os.path.exists(path):
            os.unlink(path)
        self._listener = Listener(path, family="AF_UNIX", authkey=bytes.fromhex(endpoint["authkey"]))
        os.chmod(path, 0o600)
        self._closed = False
        threading.Thread(target=self._accept, name="strata-kv-rpc", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # a client that failed the challenge, or the listener closed
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="strata-kv-rpc-conn", daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            while True:
                try:
                    op, kwargs = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if op not in OPS:
                        raise ValueError(f"unknown operation {op!r}")
                    reply = ("ok", getattr(self.target, op)(**kwargs))
                except Exception as exc:  # the caller decides; the service keeps serving
                    reply = ("error", type(exc).__name__, str(exc)[:500])
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return

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

    def _connect(self, wait_s: float):
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return Client(self._endpoint["socket"], family="AF_UNIX",
                              authkey=bytes.fromhex(self._endpoint["authkey"]))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def call(self, op: str, *, timeout: float = 60.0, connect_wait: float = _CONNECT_TIMEOUT_S, **kwargs) -> Any:
        """The result of ``op(**kwargs)`` on the service. ``TimeoutError`` when no answer came in
        ``timeout`` seconds, ``OSError`` when it cannot be reached, ``TierCallError`` when it failed."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect(connect_wait)
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
