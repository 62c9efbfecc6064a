"""The keys a restore needs: where this installation keeps each one, fingerprints, installing them.

- ``master``: wraps the tenants' L3 data keys (``strata_env.masterkey``: ``STRATA_MASTER_KEY``,
  ``STRATA_MASTER_KEY_FILE`` or ``$STRATA_HOME/master.key``). Without it the database's wrapped data
  keys open nothing, and no L3 object written before the backup is readable again.
- ``audit``: the audit chain's HMAC key (``settings.STRATA_AUDIT_KEY`` or the file
  ``settings.STRATA_AUDIT_KEY_FILE``). Without it the restored chain does not verify.
- ``secret``: Django's ``SECRET_KEY`` (``STRATA_SECRET_KEY`` or ``$STRATA_HOME/secret_key``). It signs
  sessions and CSRF tokens only: nothing stored is sealed or hashed with it.

A key kept in a file is archived as the file's bytes. A key given by an environment variable (a
secret manager's) is not archived: the manifest records its fingerprint only, and the restore checks
that the target's key has it. Fingerprints are 16 hex characters of a domain-separated SHA-256 (the
master key's is ``controlplane.common.masterkey.fingerprint``, the one ``/metrics`` compares).

Restore rules (:func:`plan` decides, before anything is written; :func:`install` acts):

- ``master`` and ``audit`` are never replaced, ``--force`` or not: the target's key (its variable or
  its existing file) must have the archive's fingerprint; a missing file is created from the archive
  (mode 0600, exclusively); a target key that differs, or none where the archive holds none, is an
  error that names both fingerprints.
- ``secret``: the archive's file replaces the target's (every first start of a control plane creates
  one, so a fresh target always has its own; replacing it only ends sessions signed by that one). A
  target that takes it from ``STRATA_SECRET_KEY`` keeps its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

import strata_env
from controlplane import env as envmod
from controlplane.backups.manifest import BackupError
from controlplane.common import masterkey
from strata_env import masterkey as reader

NAMES = ("master", "audit", "secret")
VARIABLES = {"master": "STRATA_MASTER_KEY", "audit": "STRATA_AUDIT_KEY", "secret": "STRATA_SECRET_KEY"}
LABELS = {"master": "master key", "audit": "audit key", "secret": "Django secret key"}
_CONSEQUENCE = {
    "master": "the database's data keys are wrapped by the archive's master key, so no other key opens them",
    "audit": "the archive's audit chain is hashed with the archive's audit key and verifies under no other",
}


@dataclass(frozen=True)
class KeyInfo:
    """One key as this process's settings take it."""

    name: str
    source: str  # "env" | "file" | "absent" (a file that does not exist)
    path: Path | None  # the file (None for "env")
    material: bytes | None  # the key as it is used; None when absent
    raw: bytes | None  # the file's bytes, to archive; None unless "file"


@dataclass(frozen=True)
class KeyAction:
    """What a restore does with one key: ``kept`` (the target has the same one), ``environment``
    (the target's variable has it), ``created``/``replaced`` (``data`` is written to ``path``),
    ``absent`` (the backed-up installation had none)."""

    name: str
    action: str
    path: Path | None
    data: bytes | None = None


def fingerprint(name: str, material: bytes) -> str:
    if name == "master":
        return masterkey.fingerprint(material)
    return hashlib.sha256(f"strata/{name}-key-fingerprint/v1\x00".encode() + material).hexdigest()[:16]


def material_of(name: str, raw: bytes) -> bytes:
    """The key a file's bytes hold (as the readers take them: the master key raw or base64, the
    others as text without surrounding whitespace)."""
    if name == "master":
        return raw if len(raw) == reader.KEY_BYTES else masterkey.decode_key(raw, "the archived master key")
    return raw.decode("utf-8").strip().encode("utf-8")


def _file(name: str, path: Path) -> KeyInfo:
    try:
        if name == "master":
            reader.read_key_file(path, missing_ok=True)  # its mode and type checks: refuse what they refuse
        raw = path.read_bytes()
    except FileNotFoundError:
        return KeyInfo(name, "absent", path, None, None)
    except (OSError, reader.MasterKeyError) as exc:
        raise BackupError(f"cannot read the {LABELS[name]} at {path}: {exc}") from None
    return KeyInfo(name, "file", path, material_of(name, raw), raw)


def current(name: str) -> KeyInfo:
    """Where this process takes key ``name`` from, and the key (read now, never created)."""
    if name == "master":
        env = strata_env.master_key_env()
        source, path = masterkey.resolve(env)
        if source == "env":
            return KeyInfo(name, "env", None, reader.read(env), None)
        assert path is not None
        return _file(name, path)
    if name == "audit":
        if settings.STRATA_AUDIT_KEY:
            return KeyInfo(name, "env", None, str(settings.STRATA_AUDIT_KEY).encode("utf-8"), None)
        return _file(name, Path(settings.STRATA_AUDIT_KEY_FILE))
    env = envmod.load()
    if env.secret_key:
        return KeyInfo(name, "env", None, env.secret_key.encode("utf-8"), None)
    return _file(name, env.secret_key_file)


def manifest_entry(info: KeyInfo, member: str) -> dict:
    return {"source": info.source, "member": member if info.raw is not None else None,
            "fingerprint": fingerprint(info.name, info.material) if info.material is not None else None}


def plan(name: str, entry: dict, archived: bytes | None) -> KeyAction:
    """What the restore will do with key ``name`` (``entry``: the manifest's; ``archived``: the
    member's bytes, verified). Raises :class:`BackupError` when the restore must not go on."""
    expected = entry.get("fingerprint")
    label, variable = LABELS[name], VARIABLES[name]
    if archived is not None and expected is not None and fingerprint(name, material_of(name, archived)) != expected:
        raise BackupError(f"the archive's {label} does not have the fingerprint its manifest names")
    target = current(name)
    if name == "secret":
        if target.source == "env" or archived is None:
            return KeyAction(name, "environment" if target.source == "env" else "absent", target.path)
        if target.raw == archived:
            return KeyAction(name, "kept", target.path)
        return KeyAction(name, "replaced" if target.source == "file" else "created", target.path, archived)
    if expected is None:
        return KeyAction(name, "absent", target.path)
    if target.material is not None:
        found = fingerprint(name, target.material)
        if found != expected:
            where = variable if target.source == "env" else str(target.path)
            raise BackupError(f"{where} holds another {label} (fingerprint {found}; the archive's is {expected}): "
                              f"{_CONSEQUENCE[name]}. Give this installation the archive's {label} and restore again")
        return KeyAction(name, "environment" if target.source == "env" else "kept", target.path)
    if archived is None:
        raise BackupError(f"the archive does not hold the {label}: the backed-up installation read it from "
                          f"{variable}. Set {variable} (or write the key to {target.path}) to the key with "
                          f"fingerprint {expected}, then restore again")
    return KeyAction(name, "created", target.path, archived)


def install(action: KeyAction) -> None:
    """Write ``action.data`` to ``action.path`` (mode 0600, in a 0700 folder): exclusively for a
    created key, atomically over the old file for a replaced one."""
    if action.action not in ("created", "replaced"):
        return
    assert action.path is not None and action.data is not None
    path = action.path
    envmod.private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.restore-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(action.data)
            fh.flush()
            os.fsync(fh.fileno())
        if action.action == "replaced":
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise BackupError(f"{path} appeared while the restore ran; check it and restore again") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if action.name == "master":
        masterkey.forget()  # this process reads the installed key from now on
