"""Bearer secrets (tenant API keys, operator tokens): generation, storage form and comparison.

A secret is ``<kind prefix><43 url-safe chars>`` (256 random bits). Only its visible ``prefix``
(first :data:`PREFIX_LEN` characters, used to find candidates) and the SHA-256 hex of the whole
secret are stored; the secret itself is returned once by the creating service. Comparison is
``hmac.compare_digest`` over digests, so timing reveals nothing about stored values.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import NamedTuple

PREFIX_LEN = 14
_DUMMY_DIGEST = hashlib.sha256(b"strata-no-such-secret").hexdigest()


class NewSecret(NamedTuple):
    raw: str  # show once, never store or log
    prefix: str
    digest: str


def secret_digest(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def secret_prefix(raw: str) -> str:
    return raw[:PREFIX_LEN]


def new_secret(kind: str) -> NewSecret:
    """A fresh secret starting with ``kind`` (``"sk-st-"`` tenant keys, ``"st-op-"`` operators)."""
    raw = kind + secrets.token_urlsafe(32)
    return NewSecret(raw=raw, prefix=secret_prefix(raw), digest=secret_digest(raw))


def secret_matches(raw: str, stored_digest: str | None) -> bool:
    """Constant-time check of ``raw`` against a stored digest (``None`` = compare against a dummy
    so that "no candidate" costs the same as "wrong secret")."""
    candidate = secret_digest(raw)
    return hmac.compare_digest(candidate, stored_digest or _DUMMY_DIGEST) and stored_digest is not None
