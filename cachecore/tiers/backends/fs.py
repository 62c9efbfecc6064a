"""L3 backend: objects as files under a root directory (default ``$STRATA_HOME/l3``).

Layout: the object ``a/b/c`` is the file ``<root>/a/b/c``. The root and every directory are created
mode 0700, files 0600. A ``put`` writes a temporary file ``.<name>.tmp-<random>`` in the final
directory, fsyncs it, renames it over the final name (atomic on POSIX) and fsyncs the directory
(``put_new`` hard-links it to the final name instead, which fails if that exists), so
a reader sees the old object or the whole new one, and a writer killed mid-write leaves only a
temporary file that no read or listing ever returns (``sweep_temp`` removes it later).

Failures: a missing object is ``None``/``False``; anything else the filesystem says (permission
denied, the root is gone or is not a directory, I/O error, disk full) is ``BackendUnavailable``.
Several processes may share one root (they see each other's objects).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends.base import Backend, Data, ObjectInfo, check_name

_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV)
_TEMP = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")


class FileBackend(Backend):
    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root
        self.fsync = fsync
        #: Test hook: called with the temporary file's path after it is written and fsynced, before
        #: the rename (a test kills the process there to simulate a crash mid-write).
        self.before_rename: Callable[[str], None] | None = None
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            if os.stat(self.root).st_uid == os.geteuid():
                os.chmod(self.root, 0o700)
        except OSError:
            pass  # reported as BackendUnavailable by the first operation, not at start

    # ------------------------------------------------------------------ contract
    def put(self, name: str, data: Data) -> None:
        tmp, path = self._write_temp(name, data)
        try:
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            _unlink_quietly(tmp)
            raise BackendUnavailable(f"l3 fs put failed: {_why(exc)}") from None

    def put_new(self, name: str, data: Data) -> bool:
        tmp, path = self._write_temp(name, data)
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: the file system's create-if-absent
            written = True
        except FileExistsError:
            written = False
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                _unlink_quietly(tmp)
                raise BackendUnavailable(f"l3 fs put failed: {_why(exc)}") from None
            written = self._replace_if_absent(tmp, path)
        finally:
            _unlink_quietly(tmp)
        if written and self.fsync:
            try:
                _fsync_dir(os.path.dirname(path))
            except OSError as exc:
                raise BackendUnavailable(f"l3 fs put failed: {_why(exc)}") from None
        return written

    def _replace_if_absent(self, tmp: str, path: str) -> bool:
        """``put_new`` on a file system without hard links: a check, then the rename (not one step:
        two such writers may both write, each object whole)."""
        try:
            if os.path.lexists(path):
                return False
            os.replace(tmp, path)
            return True
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs put failed: {_why(exc)}") from None

    def _write_temp(self, name: str, data: Data) -> tuple[str, str]:
        """Write ``data`` to a temporary file beside ``name``'s (fsynced unless ``fsync=False``);
        returns ``(temporary path, final path)``."""
        path = self._path(name)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(8)}")
        try:
            for attempt in range(3):
                try:
                    self._makedirs(directory)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    break
                except FileNotFoundError:  # a concurrent delete_prefix pruned the directory
                    if attempt == 2:
                        raise
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.before_rename is not None:
                self.before_rename(tmp)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise BackendUnavailable(f"l3 fs put failed: {_why(exc)}") from None
        return tmp, path

    def get(self, name: str) -> bytes | None:
        return self._read(name, -1, "get")

    def head(self, name: str, n: int) -> bytes | None:
        return self._read(name, n, "head")

    def get_into(self, name: str, out: memoryview) -> int | None:
        path = self._path(name)
        try:
            with open(path, "rb", buffering=0) as f:  # one inode: a concurrent put replaces, never edits it
                size = os.fstat(f.fileno()).st_size
                view, got = out[: min(size, len(out))], 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise BackendUnavailable("l3 fs get failed: the file shrank while read")
                    got += n
                return size
        except FileNotFoundError:
            self._check_root()
            return None
        except IsADirectoryError:
            return None
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs get failed: {_why(exc)}") from None

    def _read(self, name: str, n: int, op: str) -> bytes | None:
        """The object's first ``n`` bytes (``-1``: all of it); None when it does not exist."""
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                return f.read(n)
        except FileNotFoundError:
            self._check_root()
            return None
        except IsADirectoryError:
            return None
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs {op} failed: {_why(exc)}") from None

    def exists(self, name: str) -> bool:
        path = self._path(name)
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except FileNotFoundError:
            self._check_root()
            return False
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs exists failed: {_why(exc)}") from None

    def delete(self, name: str) -> bool:
        path = self._path(name)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            self._check_root()
            return False
        except IsADirectoryError:
            return False
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs delete failed: {_why(exc)}") from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_name(prefix, prefix=True)
        head = prefix.rpartition("/")[0]
        start = os.path.join(self.root, *head.split("/")) if head else self.root
        self._check_root()
        try:
            yield from self._walk(start, head, prefix)
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs list failed: {_why(exc)}") from None

    def delete_prefix(self, prefix: str) -> tuple[int, int]:
        objects = n_bytes = 0
        for info in list(self.list(prefix)):
            try:
                os.unlink(os.path.join(self.root, *info.name.split("/")))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise BackendUnavailable(f"l3 fs delete failed: {_why(exc)}") from None
            objects += 1
            n_bytes += info.size
        head = prefix.rpartition("/")[0]
        if head:
            self._prune(os.path.join(self.root, *head.split("/")))
        return objects, n_bytes

    def usage(self) -> int:
        return sum(info.size for info in self.list(""))

    def sweep_temp(self, older_than_seconds: float, *, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - older_than_seconds
        removed = 0
        self._check_root()
        try:
            for dirpath, _, filenames in os.walk(self.root):
                for fname in filenames:
                    if not _TEMP.match(fname):
                        continue
                    path = os.path.join(dirpath, fname)
                    try:
                        if os.stat(path).st_mtime < cutoff:
                            os.unlink(path)
                            removed += 1
                    except FileNotFoundError:
                        continue
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs sweep failed: {_why(exc)}") from None
        return removed

    # ------------------------------------------------------------------ internals
    def _path(self, name: str) -> str:
        return os.path.join(self.root, *check_name(name).split("/"))

    def _makedirs(self, directory: str) -> None:
        """Create ``directory`` and every missing parent below the root, each mode 0700 (``os.makedirs``
        applies its mode to the leaf only)."""
        if os.path.isdir(directory):
            return
        self._check_root()
        rel = os.path.relpath(directory, self.root)
        path = self.root
        for part in rel.split(os.sep):
            path = os.path.join(path, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)

    def _check_root(self) -> None:
        try:
            if stat.S_ISDIR(os.stat(self.root).st_mode):
                return
            raise BackendUnavailable(f"l3 fs root {self.root} is not a directory")
        except OSError as exc:
            raise BackendUnavailable(f"l3 fs root unusable: {_why(exc)}") from None

    def _walk(self, directory: str, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # no such prefix (or pruned meanwhile)
        for entry in entries:
            if entry.name.startswith("."):
                continue  # temporary files of writes in progress (or interrupted)
            name = f"{rel}/{entry.name}" if rel else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    sub = name + "/"
                    if sub.startswith(prefix) or prefix.startswith(sub):
                        yield from self._walk(entry.path, name, prefix)
                elif entry.is_file(follow_symlinks=False) and name.startswith(prefix):
                    st = entry.stat(follow_symlinks=False)
                    yield ObjectInfo(name, st.st_size, st.st_mtime)
            except FileNotFoundError:
                continue  # deleted while listing

    def _prune(self, directory: str) -> None:
        """Remove empty directories under (and including) ``directory``, never the root."""
        for dirpath, _, _ in os.walk(directory, topdown=False):
            if os.path.abspath(dirpath) == self.root:
                continue
            with contextlib.suppress(OSError):  # not empty (a concurrent put), or gone
                os.rmdir(dirpath)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _why(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"
