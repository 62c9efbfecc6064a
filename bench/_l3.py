"""L3 pieces of ``bench.tiers``: a throwaway redis-server, L3 stores, and the L3 throughput table."""

from __future__ import annotations

import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from cachecore import crypto
from cachecore.layout import KVLayout
from cachecore.tiers.backends import open_backend
from cachecore.tiers.base import Tag
from cachecore.tiers.remote import RemoteStore


@contextmanager
def redis_server():
    """A redis-server of our own on a free port (never the machine's 6379); None if not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def keyring(tenant: str = "bench") -> crypto.Keyring:
    ring = crypto.Keyring()
    ring.add(tenant, 1, crypto.generate_key())
    return ring


def store(url: str, layout: KVLayout, ring: crypto.Keyring, *, chunk_blocks: int = 16) -> RemoteStore:
    # A bench wants steady timings, not the 0.2 s production read timeout that turns slow reads into misses.
    opts = {"socket_timeout": 5.0} if url.startswith("redis") else {}
    return RemoteStore(open_backend(url, **opts), ring, layout, chunk_blocks=chunk_blocks)


def throughput(layout: KVLayout, redis_url: str | None, *, chunks: int, rounds: int) -> dict:
    """L3 put/get GB/s of KV, each the median of ``rounds``. Filesystem: the store (encrypted) vs
    AES-256-GCM alone on the same frames. Redis, every row on the same frame size, interleaved round
    by round (a busy machine slows them alike): raw redis-py SET/GET; the backend alone (its
    conditional write ``put_new``, its windowed read ``get_into``: what the store asks of Redis);
    the whole store (sealing, framing and the existence probe on top: ``put_chunks`` of the set, one
    ``get`` per chunk)."""
    ring = keyring()
    cb = 16
    tag = Tag("bench", "m", "r", b"\x00" * 32)
    kv = torch.randn(cb, *layout.page_shape).to(layout.torch_dtype)
    tokens = list(range(cb * layout.block_size))
    kv_bytes = kv.numel() * kv.element_size()
    samples: dict[str, list[float]] = {}
    root = Path(tempfile.mkdtemp(prefix="strata-bench-l3-"))

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        samples.setdefault(name, []).append(chunks * kv_bytes / (time.perf_counter() - t0) / 1e9)

    order = random.Random(0)
    state = {"round": 0}  # each round writes fresh names (a duplicate would be skipped)

    def interleaved(*groups: dict, untimed: dict | None = None) -> None:
        """Each round (``state["round"]`` counts them) runs every group in turn and the rows of a
        group in a random order (the row right after a switch pays for it: no row always does),
        ``untimed[name]`` (if any) just before its row."""
        for group in groups:
            for name in group:
                samples.setdefault(name, [])  # the table's order: as written
        for _ in range(rounds):
            state["round"] += 1
            for group in groups:
                for name in order.sample(list(group), len(group)):
                    (untimed or {}).get(name, lambda: None)()
                    timed(name, group[name])

    # Every timed put must write and every get return the whole chunk: a skipped put or a missed get
    # costs next to nothing, and its GB/s would time that.
    def stored(written) -> None:
        if not all(written):
            raise SystemExit("an L3 put was skipped, not written: nothing measured")

    def fetched(got) -> None:
        if got.stopped is not None or len(got.kv) != cb:
            raise SystemExit(f"an L3 get returned {len(got.kv)} of {cb} blocks ({got.stopped}): nothing measured")

    prefixes = [[os.urandom(32) for _ in range(cb - 1)] for _ in range(chunks)]

    def chain(i: int) -> list[bytes]:
        return prefixes[i] + [(state["round"] * 100000 + i).to_bytes(32, "little")]

    def put_all(st: RemoteStore) -> None:
        stored(st.put_chunks([(chain(i), tokens, kv) for i in range(chunks)], tag))

    def get_all(st: RemoteStore) -> None:
        for i in range(chunks):
            fetched(st.get(chain(i), tokens, tag, cb))

    try:
        fs = store(root.as_uri(), layout, ring)
        interleaved({"fs put (encrypted)": lambda: put_all(fs)}, {"fs get (decrypted)": lambda: get_all(fs)})
        key = ring.active("bench")[1]
        plain = kv.contiguous().view(torch.uint8).numpy().tobytes()
        frames = [crypto.seal(key, version=1, aad=b"x", plaintext=plain) for _ in range(chunks)]
        interleaved({"AES-256-GCM seal alone": lambda: [crypto.seal(key, version=1, aad=b"x", plaintext=plain)
                                                        for _ in range(chunks)],
                     "AES-256-GCM open alone": lambda: [crypto.open_frame(key, f, b"x") for f in frames]})
        if redis_url is not None:
            from cachecore.tiers.backends.redis import connect_client

            rs = store(redis_url, layout, ring)
            backend = rs.backend
            raw = connect_client(redis_url, timeout=5.0, connect_timeout=5.0)  # redis-py as the backend sets it up
            frame = bytes(frames[0])  # a chunk's KV sealed: an object's size but for its token ids
            buf = memoryview(bytearray(len(frame)))

            def backend_put() -> None:
                stored([backend.put_new(f"bench-backend/{state['round']}/{i}", frame) for i in range(chunks)])

            def backend_get() -> None:
                if any(backend.get_into(f"bench-backend/{state['round']}/{i}", buf) != len(frame)
                       for i in range(chunks)):
                    raise SystemExit("a backend read missed: nothing measured")

            # A cache writes new names (a conditional write never replaces), and Redis spends about twice the CPU
            # on a multi-MB SET of a new key as on one replacing a key of the same size (its memory is reused).
            # So the raw baseline writes new keys too, each round after deleting the previous round's, untimed,
            # as the backend and the store rows do; the replacing SET is printed beside it for reference.
            def raw_set() -> None:
                for i in range(chunks):
                    raw.set(f"raw:{state['round']}:{i}", frame)

            def raw_get() -> None:
                if any(len(raw.get(f"raw:{state['round']}:{i}") or b"") != len(frame) for i in range(chunks)):
                    raise SystemExit("a raw GET missed: nothing measured")

            interleaved({
                "redis-py SET raw": raw_set,
                "redis-py SET raw, same keys": lambda: [raw.set(f"same:{i}", frame) for i in range(chunks)],
                "redis backend put": backend_put,
                "redis put (encrypted)": lambda: put_all(rs),
            }, {
                "redis-py GET raw": raw_get,
                "redis backend get": backend_get,
                "redis get (decrypted)": lambda: get_all(rs),
            }, untimed={
                "redis-py SET raw": lambda: raw.delete(*[f"raw:{state['round'] - 1}:{i}" for i in range(chunks)]),
                "redis backend put": lambda: backend.delete_prefix("bench-backend/"),
                "redis put (encrypted)": lambda: rs.delete_scope(tenant="bench"),
            })  # fmt: skip
            raw.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {name: statistics.median(v) for name, v in samples.items()}
