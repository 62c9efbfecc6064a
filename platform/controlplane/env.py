"""The control plane's settings from the environment, and its private files.

The environment is read by ``strata_env`` (the one reader for every process: web, Celery, the cache
workers, the launcher); this module re-exports the control plane's view of it (:class:`StrataEnv`,
:func:`load`, :class:`EnvError`, ``REPO_ROOT``, ``TRUE``/``FALSE``) under the names Django's settings
and the rest of the control plane import, and holds the helpers for the private state in
``$STRATA_HOME``: :func:`private_dir`, :func:`private_file`, :func:`secret_key_from_file`. Other
modules read ``settings`` (or call :func:`load`), never ``os.environ``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from strata_env import FALSE, REPO_ROOT, TRUE, EnvError, StrataEnv, load

__all__ = ["FALSE", "REPO_ROOT", "TRUE", "EnvError", "StrataEnv", "load", "private_dir", "private_file",
           "secret_key_from_file"]


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) mode 0700; an existing one of ours is tightened to 0700.

    ``STRATA_HOME`` holds the database, broker files, keys and logs: nobody else may read it. A
    shared sticky folder (``/tmp``) is never changed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077 and not info.st_mode & stat.S_ISVTX:
        path.chmod(0o700)
    return path


def private_file(path: Path, *companions: str) -> Path:
    """Create ``path`` empty with mode 0600 if it is missing, and tighten it (and the companion
    files ``path`` + suffix that exist, e.g. SQLite's ``-wal``/``-shm``) to 0600 when they are ours.

    SQLite gives its ``-wal``, ``-shm`` and journal files the mode of the database file, so a
    database created here first stays private whatever the process umask."""
    private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for candidate in (path, *(path.with_name(path.name + suffix) for suffix in companions)):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            info = candidate.stat()
            if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
                candidate.chmod(0o600)
    return path


def secret_key_from_file(path: Path) -> str:
    """Return the key stored at ``path``, generating it (mode 0600, in a 0700 folder) on first use.

    The file appears atomically with its content (written aside, then hard-linked into place), so
    two processes starting at once agree on one key and never read a half-written file.
    """
    if path.exists():
        return path.read_text().strip()
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(50) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()
