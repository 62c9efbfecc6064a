"""L3 pieces of ``bench.tiers``: a throwaway redis-server, L3 stores, and the L3 throughput table."""

from __future__ import annotations

import os
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
    """L3 put/get GB/s: Redis backend (encrypted) vs raw redis-py SET/GET of the same frame sizes; the
    filesystem backend vs AES-256-GCM alone on the same frames. Each figure is the median of rounds."""
    ring = keyring()
    cb = 16
    tag = Tag("bench", "m", "r", b"\x00" * 32)
    kv = torch.randn(cb, *layout.page_shape).to(layout.torch_dtype)
    tokens = list(range(cb * layout.block_size))
    kv_bytes = kv.numel() * kv.element_size()
    rows: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix="strata-bench-l3-"))

    def measure(name: str, fn) -> None:
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            samples.append(chunks * kv_bytes / (time.perf_counter() - t0) / 1e9)
        rows[name] = statistics.median(samples)

    def hashes(i: int) -> list[bytes]:
        return [os.urandom(32) for _ in range(cb - 1)] + [i.to_bytes(32, "little")]

    # Every timed put must write and every get return the whole chunk: a skipped put or a missed get
    # costs next to nothing, and its GB/s would time that.
    def stored(written: bool) -> None:
        if not written:
            raise SystemExit("an L3 put was skipped, not written: nothing measured")

    def fetched(got) -> None:
        if got.stopped is not None or len(got.kv) != cb:
            raise SystemExit(f"an L3 get returned {len(got.kv)} of {cb} blocks ({got.stopped}): nothing measured")

    chains = [hashes(i) for i in range(chunks)]
    try:
        fs = store(root.as_uri(), layout, ring)
        state = {"round": 0}  # each round writes fresh names (a duplicate would be skipped)

        def fs_put() -> None:
            state["round"] += 1
            for i, chain in enumerate(chains):
                stored(fs.put_chunk(chain[:-1] + [(state["round"] * 100000 + i).to_bytes(32, "little")], tokens,
                                    tag, kv))

        def fs_get() -> None:
            for i, chain in enumerate(chains):
                c = chain[:-1] + [(state["round"] * 100000 + i).to_bytes(32, "little")]
                fetched(fs.get(c, tokens, tag, cb))

        measure("fs put (encrypted)", fs_put)
        measure("fs get (decrypted)", fs_get)
        key = ring.active("bench")[1]
        plain = kv.contiguous().view(torch.uint8).numpy().tobytes()
        frames = [crypto.seal(key, version=1, aad=b"x", plaintext=plain) for _ in range(chunks)]
        measure("AES-256-GCM seal alone", lambda: [crypto.seal(key, version=1, aad=b"x", plaintext=plain)
                                                    for _ in range(chunks)])
        measure("AES-256-GCM open alone", lambda: [crypto.open_frame(key, f, b"x") for f in frames])
        if redis_url is not None:
            import redis

            rs = store(redis_url, layout, ring)
            raw = redis.Redis.from_url(redis_url, socket_timeout=5)
            frame = bytes(frames[0])
            state["round"] = 0

            def rs_put() -> None:
                state["round"] += 1
                for i, chain in enumerate(chains):
                    stored(rs.put_chunk(chain[:-1] + [(state["round"] * 100000 + i).to_bytes(32, "little")], tokens,
                                        tag, kv))

            def rs_get() -> None:
                for i, chain in enumerate(chains):
                    fetched(rs.get(chain[:-1] + [(state["round"] * 100000 + i).to_bytes(32, "little")], tokens, tag,
                                   cb))

            measure("redis put (encrypted)", rs_put)
            measure("redis get (decrypted)", rs_get)
            measure("redis-py SET raw", lambda: [raw.set(f"raw:{i}", frame) for i in range(chunks)])
            measure("redis-py GET raw", lambda: [raw.get(f"raw:{i}") for i in range(chunks)])
            raw.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
