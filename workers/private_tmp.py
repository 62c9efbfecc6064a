"""A private folder for what the local Ray head writes (``make run``'s ``--temp-dir``).

Ray makes its temp root and every session folder (``session_*``, ``sockets/``, ``logs/``,
``runtime_resources/``) mode 0777 without the sticky bit, whatever the umask and whatever mode the
folder had, so another local user could rename and replace a socket of the running head. Strata
therefore gives Ray a temp root *inside* a folder of its own, ``$TMPDIR/strata-<uid>`` (``/tmp`` when
``TMPDIR`` is unset): Ray may widen what it creates in there, but never that folder, and other users
cannot traverse it to reach anything below.

:func:`private_root` creates that folder or checks the one there, every start:

- it must be a folder, not a symbolic link, owned by the user: anything else is refused
  (:class:`UnsafeFolderError`, one line naming the path and what to do);
- group and other permissions on it are removed (repaired, and reported as such);
- every folder above it must be owned by the user or by root, and not writable by others unless
  sticky (``/tmp`` is fine: its sticky bit stops others renaming the user's entry): otherwise another
  user could swap the whole folder, and that is refused too.

:func:`ray_temp_dir` is the folder inside it that Ray is given (Ray creates it). Socket paths live
under it and must fit in 107 bytes, so the root stays short (never ``$STRATA_HOME``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

RAY_SUBDIR = "ray"


class UnsafeFolderError(RuntimeError):
    """A folder on the way to the private root is not safe to use; the message says which and why."""


class PrivateRoot(NamedTuple):
    path: Path  # the folder: mode 0700, owned by the user
    repaired: bool  # it was there with group or other permissions, now removed


def root_path(base: Path | None = None, uid: int | None = None) -> Path:
    """``<base>/strata-<uid>``; ``base`` defaults to the system temp folder (``TMPDIR``)."""
    return Path(base or tempfile.gettempdir()) / f"strata-{os.getuid() if uid is None else uid}"


def check_ancestors(folder: Path, uid: int) -> None:
    """Raise :class:`UnsafeFolderError` unless every folder from ``/`` down to ``folder`` (symbolic
    links resolved) is owned by ``uid`` or root and writable by no one else unless sticky."""
    real = Path(os.path.realpath(folder))
    for path in (*reversed(real.parents), real):
        info = os.stat(path)
        if info.st_uid not in (uid, 0):
            raise UnsafeFolderError(f"{path} belongs to user {info.st_uid}, who could replace what is in it; "
                                    "set TMPDIR to a folder of yours")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise UnsafeFolderError(f"{path} is writable by other users without the sticky bit (mode "
                                    f"{stat.S_IMODE(info.st_mode):o}); set TMPDIR to a private folder")


def private_root(base: Path | None = None, uid: int | None = None) -> PrivateRoot:
    """Create or check ``root_path(base, uid)`` as the module docstring says; ``uid`` (default this
    process's) is the user it must belong to. Raises :class:`UnsafeFolderError`."""
    uid = os.getuid() if uid is None else uid
    path = root_path(base, uid)
    check_ancestors(path.parent, uid)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        # O_NOFOLLOW: a symbolic link planted in its place is refused, never followed.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        what = "a symbolic link" if path.is_symlink() else f"not a folder ({exc.strerror})"
        raise UnsafeFolderError(f"{path} is {what}; remove it or set TMPDIR") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != uid:
            raise UnsafeFolderError(f"{path} belongs to user {info.st_uid}, not {uid}; remove it or set TMPDIR")
        repaired = bool(stat.S_IMODE(info.st_mode) & 0o077)
        if repaired:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return PrivateRoot(path, repaired)


def ray_temp_dir(root: Path) -> Path:
    """The temp root Ray is given inside ``root`` (Ray creates it and may widen it; ``root`` stays 0700)."""
    return root / RAY_SUBDIR
