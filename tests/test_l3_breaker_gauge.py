"""L3's circuit breaker as a figure (``RemoteStore.gauges`` -> ``l3_figures`` -> /metrics'
``strata_tier_breaker_open``, which the StrataL3BreakerOpen alert reads): 0 while the backend answers,
1 from its first failure until a call succeeds again (open, and half-open with no call yet), and the
figures' own listing is such a call, so an idle store closes it once the backend is back. A real
filesystem backend whose root is replaced by a file (every call fails, as a lost mount does)."""

from __future__ import annotations

import os
import time

from cachecore.crypto import Keyring, generate_key
from cachecore.layout import KVLayout
from cachecore.tiers.backends.fs import FileBackend
from cachecore.tiers.base import Tag
from cachecore.tiers.remote import RemoteStore, l3_figures
from cachecore.tiers.remote.breaker import HALF_OPEN

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
COOLDOWN = 0.05
TAG = Tag("t1", "m1", "r1", b"\x01" * 32, True)


def _store(root, *, refresh_seconds: float) -> RemoteStore:
    keyring = Keyring()
    keyring.add("t1", 1, generate_key())
    return RemoteStore(FileBackend(root), keyring, LAYOUT, chunk_blocks=4, retry_after_seconds=COOLDOWN,
                       refresh_seconds=refresh_seconds)


def _break(root) -> None:
    os.rename(root, str(root) + ".away")
    root.write_bytes(b"not a directory")


def _restore(root) -> None:
    os.unlink(root)
    os.rename(str(root) + ".away", root)


def test_the_breaker_figure_is_1_from_a_failure_until_a_listing_succeeds_again(tmp_path):
    root = tmp_path / "l3"
    store = _store(root, refresh_seconds=0.0)  # every figures call lists the backend
    assert store.gauges()["breaker_open"] == 0 and store.gauges()["breaker_opens"] == 0
    _break(root)
    try:
        g = store.gauges()  # the listing fails: counted, and the breaker opens
        assert g["breaker_open"] == 1 and g["breaker_opens"] == 1 and g["failures"] == 1
        time.sleep(COOLDOWN * 2)
        assert store.gauges()["breaker_open"] == 1  # tried again after the cooldown, failed again
    finally:
        _restore(root)
    time.sleep(COOLDOWN * 2)
    g = store.gauges()  # the backend answers the listing: closed without any request
    assert g["breaker_open"] == 0 and g["breaker_opens"] == 2


def test_a_half_open_breaker_with_no_call_since_still_reads_open(tmp_path):
    root = tmp_path / "l3"
    store = _store(root, refresh_seconds=3600.0)  # the figures do not list again: no call at all
    store.gauges()  # loads the index (one listing, which succeeds)
    _break(root)
    try:
        assert store.gauges()["breaker_open"] == 0  # the index is fresh: no call, nothing known yet
        assert store.probe([b"\x00" * 32] * 4, TAG) == 0  # the backend fails this call
        time.sleep(COOLDOWN * 2)
        assert store._breaker.state == HALF_OPEN
        assert store.gauges()["breaker_open"] == 1  # nothing has answered since the failure
    finally:
        _restore(root)


def test_the_l3_row_carries_the_breaker_to_the_exporter(tmp_path):
    root = tmp_path / "l3"
    store = _store(root, refresh_seconds=0.0)
    row = l3_figures(store.gauges(), store.chunk_blocks, LAYOUT.bytes_per_block)
    assert (row["breaker_open"], row["breaker_opens"]) == (0, 0)
    _break(root)
    try:
        row = l3_figures(store.gauges(), store.chunk_blocks, LAYOUT.bytes_per_block)
    finally:
        _restore(root)
    assert (row["breaker_open"], row["breaker_opens"]) == (1, 1)
