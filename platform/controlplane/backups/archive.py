"""The archive file: written exclusively and privately, read back only after it verifies.

:class:`ArchiveWriter` never touches an existing path: it writes ``.<name>.partial-<random>`` (mode
0600, created exclusively) beside the target, fsyncs it and hard-links it into place, which fails if
the target exists meanwhile; a failure or an exception leaves nothing at the target and removes the
partial file. Members are plain files (mode 0600, owner 0); each one's SHA-256 and size are recorded
as it is written and go into the manifest, the last member.

:class:`ArchiveReader` reads a plain (uncompressed) tar. :meth:`ArchiveReader.verify` reads every
member once and refuses the archive unless each is a regular file named in the manifest with the
listed hash and size, and every listed member is present; nothing is extracted by name from the tar
(no ``extractall``): callers get each member's bytes and decide where they go, and
:meth:`ArchiveReader.members` hashes them again as they are read, so an archive changed between the
two passes is caught too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import secrets
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from controlplane.backups import manifest as mf
from controlplane.backups.manifest import BackupError

_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV)


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it (tarfile reads a member's bytes from it)."""

    def __init__(self, inner: BinaryIO) -> None:
        self.inner, self.digest, self.size = inner, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        block = self.inner.read(n)
        self.digest.update(block)
        self.size += len(block)
        return block


class ArchiveWriter:
    """Write one new archive at ``path``; use as a context manager (an exception aborts it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).absolute()
        if self.path.exists() or self.path.is_symlink():
            raise BackupError(f"{self.path} exists: a backup never overwrites a file (choose a new name)")
        if not self.path.parent.is_dir():
            raise BackupError(f"{self.path.parent} is not a directory")
        self.partial = self.path.with_name(f".{self.path.name}.partial-{secrets.token_hex(4)}")
        fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fh = os.fdopen(fd, "wb")
        self._tar = tarfile.open(fileobj=self._fh, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 (closed by finish/abort)
        self.files: dict[str, dict[str, Any]] = {}
        self._mtime = int(time.time())

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _info(self, name: str, size: int) -> tarfile.TarInfo:
        if name in self.files or name == mf.MANIFEST:
            raise ValueError(f"member {name!r} written twice")
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o600, self._mtime
        return info

    def add_bytes(self, name: str, data: bytes) -> None:
        self._tar.addfile(self._info(name, len(data)), io.BytesIO(data))
        self.files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def add_file(self, name: str, source: Path) -> None:
        """Copy ``source`` in (streamed: a database dump may be large)."""
        with open(source, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            reader = _Hashing(fh)
            self._tar.addfile(self._info(name, size), reader)
        if reader.size != size:
            raise BackupError(f"{source} changed size while it was archived")
        self.files[name] = {"sha256": reader.digest.hexdigest(), "size": size}

    def finish(self, manifest: dict[str, Any]) -> str:
        """Add the manifest (with ``files`` filled in), close, fsync and link the archive into place.
        Returns the manifest's SHA-256 (the archive's identity: the command prints it, the audit
        event records it)."""
        raw = mf.encode({**manifest, "files": self.files})
        info = tarfile.TarInfo(mf.MANIFEST)
        info.size, info.mode, info.mtime = len(raw), 0o600, self._mtime
        self._tar.addfile(info, io.BytesIO(raw))
        self._tar.close()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        try:
            os.link(self.partial, self.path)
        except FileExistsError:
            self.abort()
            raise BackupError(f"{self.path} appeared while the backup was written; it was left as it is") from None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                self.abort()
                raise
            if self.path.exists():  # no hard links here: a check, then the rename
                self.abort()
                raise BackupError(f"{self.path} appeared while the backup was written") from None
            os.replace(self.partial, self.path)
        _fsync_dir(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.partial.unlink()
        return hashlib.sha256(raw).hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._tar.close()
        with contextlib.suppress(Exception):
            self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            self.partial.unlink()


class ArchiveReader:
    """A backup archive opened for reading (a plain tar; its manifest parsed, not yet verified)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._tar = tarfile.open(self.path, mode="r:")  # noqa: SIM115 (closed by close)
        except (OSError, tarfile.TarError) as exc:
            raise BackupError(f"cannot read {self.path} as a backup archive: {exc}") from None
        try:
            member = self._tar.getmember(mf.MANIFEST)
        except KeyError:
            raise BackupError(f"{self.path} has no {mf.MANIFEST}: not a Strata backup") from None
        if not member.isreg() or member.size > mf.MAX_MANIFEST_BYTES:
            raise BackupError(f"{self.path}'s {mf.MANIFEST} is not a plain file of a sane size")
        raw = self._read(member)
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        self.manifest = mf.decode(raw)

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, member: tarfile.TarInfo) -> bytes:
        fh = self._tar.extractfile(member)
        assert fh is not None
        return fh.read()

    def _expected(self, member: tarfile.TarInfo) -> dict[str, Any]:
        listed = self.manifest["files"].get(member.name)
        if listed is None:
            raise BackupError(f"the archive holds {member.name!r}, which its manifest does not list")
        if not member.isreg():
            raise BackupError(f"the archive's member {member.name!r} is not a plain file")
        return listed

    def verify(self, keep: Callable[[str], bool] = lambda name: False) -> dict[str, bytes]:
        """Hash every member against the manifest (refusing the archive on any difference) and
        return the bytes of the members ``keep`` names (small ones: keys)."""
        seen: set[str] = set()
        kept: dict[str, bytes] = {}
        for member in self._tar:
            if member.name == mf.MANIFEST:
                continue
            listed = self._expected(member)
            if member.name in seen:
                raise BackupError(f"the archive holds {member.name!r} twice")
            seen.add(member.name)
            fh = self._tar.extractfile(member)
            assert fh is not None
            if keep(member.name):
                if member.size > mf.MAX_KEY_BYTES:
                    raise BackupError(f"the archive's {member.name!r} is too large for a key")
                data = fh.read()
                digest, size = hashlib.sha256(data).hexdigest(), len(data)
                kept[member.name] = data
            else:
                digest, size = mf.sha256_file(fh)
            if (digest, size) != (listed["sha256"], listed["size"]):
                raise BackupError(f"the archive's {member.name!r} does not match its checksum: the archive "
                                  "is damaged or was changed; nothing was restored")
        missing = sorted(set(self.manifest["files"]) - seen)
        if missing:
            raise BackupError(f"the archive lacks {len(missing)} member(s) its manifest lists, e.g. {missing[0]!r}")
        return kept

    @contextlib.contextmanager
    def _member_reader(self, member: tarfile.TarInfo) -> Iterator[BinaryIO]:
        fh = self._tar.extractfile(member)
        assert fh is not None
        reader = _Hashing(fh)
        yield reader  # type: ignore[misc]
        mf.sha256_file(reader)  # whatever the caller left unread is hashed too
        listed = self.manifest["files"][member.name]
        if (reader.digest.hexdigest(), reader.size) != (listed["sha256"], listed["size"]):
            raise BackupError(f"the archive's {member.name!r} changed since it was verified; restore stopped")

    def members(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, contextlib.AbstractContextManager]]:
        """``(name, open)`` for each member ``wanted`` names, in archive order; ``with open as fh``
        yields a reader of its bytes whose hash is checked against the manifest when the block ends:
        use what was read only after the block (it raises :class:`BackupError` on a mismatch)."""
        for member in self._tar:
            if member.name != mf.MANIFEST and wanted(member.name):
                self._expected(member)
                yield member.name, self._member_reader(member)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
