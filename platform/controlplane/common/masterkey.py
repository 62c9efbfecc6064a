"""The master key (key-encryption key) that wraps every tenant's L3 data keys (docs/design.md section 2).

Where it comes from, in this order (``strata_env.masterkey`` reads it, for the workers too):

- ``STRATA_MASTER_KEY``: base64 of exactly 32 bytes (e.g. injected by a secret manager);
- ``STRATA_MASTER_KEY_FILE``: a file holding the 32 bytes, raw or base64 text. It must exist (a
  missing production key is an error, never silently replaced: a new key could not unwrap the data
  keys already in the database);
- neither set: ``$STRATA_HOME/master.key``, created with 32 random bytes, mode 0600, on first use
  (``make run`` creates it before any process starts, so web, Celery and the Ray workers it starts
  share one file).

Setting both variables is an error (which one is meant?). A key file that group or others may read
or write is refused with a clear error: fix it with ``chmod 600``. The key is never logged, never
in the repository and never in the database.

This module adds what only the control plane does: creating the default file, keeping the key in
memory per source, and the fingerprint. Pure Python (no Django).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
from pathlib import Path

import strata_env
from controlplane import env as envmod
from strata_env import masterkey as reader
from strata_env.masterkey import KEY_BYTES, KeyVariables, MasterKeyError, decode_key, resolve

__all__ = ["KEY_BYTES", "MasterKeyError", "create_key_file", "decode_key", "ensure_master_key", "fingerprint",
           "forget", "load_master_key", "master_key", "read_key_file", "resolve"]

FINGERPRINT_DOMAIN = b"strata/master-key-fingerprint/v1\x00"
_lock = threading.Lock()
_cache: dict[tuple, bytes] = {}


def read_key_file(path: Path) -> bytes:
    """The key stored at ``path`` (``strata_env.masterkey.read_key_file``; a missing file is an error)."""
    key = reader.read_key_file(path)
    assert key is not None
    return key


def create_key_file(path: Path) -> Path:
    """Create ``path`` with 32 random bytes, mode 0600, in a 0700 folder, unless it exists. Atomic
    (written aside, then hard-linked into place): concurrent first runs agree on one key."""
    if path.exists():
        return path
    envmod.private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(KEY_BYTES))
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileExistsError):  # another process won the race: its key stands
            os.link(tmp, path)
    finally:
        tmp.unlink()
    return path


def load_master_key(env: KeyVariables) -> bytes:
    """Read (and for the default file, create on first use) the master key that ``env`` names."""
    source, path = resolve(env)
    if source == "default":
        create_key_file(path)
    key = reader.read(env)
    assert key is not None
    return key


def ensure_master_key(env: KeyVariables | None = None) -> dict[str, str]:
    """For launchers: make sure the key exists and is usable now (creating the default file), and
    return the variables that point every child process at the same key (``STRATA_MASTER_KEY_FILE``
    for a file; nothing when the key comes from ``STRATA_MASTER_KEY``, which children inherit)."""
    env = env or envmod.load()
    load_master_key(env)
    source, path = resolve(env)
    return {} if source == "env" else {"STRATA_MASTER_KEY_FILE": str(path)}


def master_key() -> bytes:
    """This process's master key (32 bytes), read once per source and then kept in memory."""
    env = strata_env.master_key_env()
    source = (env.master_key, env.master_key_path, env.home)
    with _lock:
        key = _cache.get(source)
        if key is None:
            key = _cache[source] = load_master_key(env)
    return key


def fingerprint(key: bytes) -> str:
    """16 hex chars that identify a master key without revealing it (compare processes' keys)."""
    return hashlib.sha256(FINGERPRINT_DOMAIN + key).hexdigest()[:16]


def forget() -> None:
    """Drop the in-memory copy (tests that switch keys)."""
    with _lock:
        _cache.clear()
