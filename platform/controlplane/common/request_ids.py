"""Request ids: the ``X-Request-Id`` of every response and access-log line.

A client's own ``X-Request-Id`` is kept only when the TCP peer is a trusted proxy
(``common.sources.peer_trusted``: ``STRATA_TRUSTED_PROXIES``) and the value is 1-128 characters of
``A-Z a-z 0-9 . _ : -`` (what proxies and tracing systems send; nothing that could break a log line or
a header). Anything else is replaced by a fresh id: 32 hex digits, random, never derived from the
request.
"""

from __future__ import annotations

import re
import uuid

from controlplane.common.sources import peer_trusted

HEADER = "x-request-id"
MAX_LENGTH = 128
SHAPE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_LENGTH}}}")


def request_id_new() -> str:
    return uuid.uuid4().hex


def request_id_for(*, peer: str, presented: str | None) -> str:
    """The id of a request from ``peer`` that carried ``presented`` (``None``: no header)."""
    if presented is not None and SHAPE.fullmatch(presented) and peer_trusted(peer):
        return presented
    return request_id_new()
