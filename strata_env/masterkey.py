"""The one reader of the master key (the key-encryption key of the tenants' L3 data keys).

Where it comes from, in this order:

- ``STRATA_MASTER_KEY``: base64 of exactly 32 bytes (e.g. injected by a secret manager);
- ``STRATA_MASTER_KEY_FILE``: a file holding the 32 bytes, raw or base64 text;
- neither: ``$STRATA_HOME/master.key`` (the control plane creates it on first use:
  ``controlplane.common.masterkey``; nothing here writes a key).

Setting both variables is an error (which one is meant?). A key file that group or others may
access, or that is not a regular file, is refused with the fix in the message. The key is never
logged. Used by the control plane (``controlplane.common.masterkey``, which adds the default file's
creation, a per-process cache and the fingerprint) and by the cache workers
(``workers.config.master_key``, which waits for a file that is not there yet instead of failing).
"""

from __future__ import annotations

import base64
import binascii
import stat
from pathlib import Path
from typing import Literal, Protocol

from strata_env.fields import EnvError

KEY_BYTES = 32
Source = Literal["env", "file", "default"]


class MasterKeyError(EnvError, RuntimeError):
    """The master key is missing, malformed or not private enough; the message says how to fix it.
    (An :class:`EnvError`; also a ``RuntimeError``, as the control plane's error always was.)"""


class KeyVariables(Protocol):
    """What a view carries about the key (:class:`strata_env.StrataEnv`, ``WorkerEnv``, ``MasterKeyEnv``)."""

    master_key: str | None
    master_key_path: Path | None

    @property
    def master_key_file(self) -> Path: ...


def decode_key(text: str | bytes, what: str) -> bytes:
    """Strict base64 of exactly 32 bytes -> the key."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MasterKeyError(f"{what} is not valid base64 (expected base64 of {KEY_BYTES} bytes)") from None
    if len(key) != KEY_BYTES:
        raise MasterKeyError(f"{what} decodes to {len(key)} bytes; it must be exactly {KEY_BYTES}")
    return key


def read_key_file(path: Path, *, missing_ok: bool = False) -> bytes | None:
    """The key stored at ``path`` (32 raw bytes, or base64 text of them). Refuses a file that group
    or others may access and anything that is not a regular file. A missing file is an error, or
    ``None`` with ``missing_ok``."""
    try:
        info = path.stat()  # follows symlinks: secret-store mounts link to the real file
    except FileNotFoundError:
        if missing_ok:
            return None
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


def resolve(env: KeyVariables) -> tuple[Source, Path | None]:
    """``("env", None)`` for ``STRATA_MASTER_KEY``, ``("file", path)`` for an explicit file, or
    ``("default", $STRATA_HOME/master.key)``."""
    if env.master_key and env.master_key_path:
        raise MasterKeyError("set only one of STRATA_MASTER_KEY and STRATA_MASTER_KEY_FILE")
    if env.master_key:
        return "env", None
    if env.master_key_path:
        return "file", env.master_key_path
    return "default", env.master_key_file


def read(env: KeyVariables, *, missing_ok: bool = False) -> bytes | None:
    """The key ``env`` names, read now (never created; ``missing_ok``: ``None`` for a missing file)."""
    source, path = resolve(env)
    if source == "env":
        return decode_key(env.master_key or "", "STRATA_MASTER_KEY")
    assert path is not None
    return read_key_file(path, missing_ok=missing_ok)
