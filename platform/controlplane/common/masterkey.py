"""The master key (key-encryption key) that wraps every tenant's L3 data keys (docs/design.md section 2).

Where it comes from, in this order (``controlplane.env`` reads the variables):

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

Pure Python (no Django): the cache workers import it to unwrap data keys themselves.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import secrets
import stat
import threading
from pathlib import Path

from controlplane import env as envmod

KEY_BYTES = 32
FINGERPRINT_DOMAIN = b"strata/master-key-fingerprint/v1\x00"
_lock = threading.Lock()
_cache: dict[tuple, bytes] = {}


class MasterKeyError(RuntimeError):
    """The master key is missing, malformed or not private enough; the message says how to fix it."""


def decode_key(text: str | bytes, what: str) -> bytes:
    """Strict base64 of exactly 32 bytes -> the key."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MasterKeyError(f"{what} is not valid base64 (expected base64 of {KEY_BYTES} bytes)") from None
    if len(key) != KEY_BYTES:
        raise MasterKeyError(f"{what} decodes to {len(key)} bytes; it must be exactly {KEY_BYTES}")
    return key


def read_key_file(path: Path) -> bytes:
    """The key stored at ``path`` (32 raw bytes, or base64 text of them). Refuses a file that group
    or others may access and anything that is not a regular file."""
    try:
        info = path.stat()  # follows symlinks: secret-store mounts link to the real file
    except FileNotFoundError:
        raise MasterKeyError(f"master key file {path} does not exist (STRATA_MASTER_KEY_FILE)") from None
    if not stat.S_ISREG(info.st_mode):
        raise MasterKeyError(f"master key file {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise MasterKeyError(
            f"master key file {path} has mode {mode:04o}: group/others may access it; "
            f"run 'chmod 600 {path}' (owner only) and start again")
    data = path.read_bytes()
    if len(data) == KEY_BYTES:
        return data
    return decode_key(data, f"master key file {path}")


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


def resolve(env: envmod.StrataEnv) -> tuple[str, Path | None]:
    """``("env", None)`` for ``STRATA_MASTER_KEY``, ``("file", path)`` for an explicit file, or
    ``("default", $STRATA_HOME/master.key)``."""
    if env.master_key and env.master_key_path:
        raise MasterKeyError("set only one of STRATA_MASTER_KEY and STRATA_MASTER_KEY_FILE")
    if env.master_key:
        return "env", None
    if env.master_key_path:
        return "file", env.master_key_path
    return "default", env.master_key_file


def load_master_key(env: envmod.StrataEnv) -> bytes:
    """Read (and for the default file, create on first use) the master key that ``env`` names."""
    source, path = resolve(env)
    if source == "env":
        return decode_key(env.master_key or "", "STRATA_MASTER_KEY")
    if source == "default":
        create_key_file(path)
    return read_key_file(path)


def ensure_master_key(env: envmod.StrataEnv | None = None) -> dict[str, str]:
    """For launchers: make sure the key exists and is usable now (creating the default file), and
    return the variables that point every child process at the same key (``STRATA_MASTER_KEY_FILE``
    for a file; nothing when the key comes from ``STRATA_MASTER_KEY``, which children inherit)."""
    env = env or envmod.load()
    load_master_key(env)
    source, path = resolve(env)
    return {} if source == "env" else {"STRATA_MASTER_KEY_FILE": str(path)}


def master_key() -> bytes:
    """This process's master key (32 bytes), read once per source and then kept in memory."""
    env = envmod.load()
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
