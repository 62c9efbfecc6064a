"""Hashing a revision's weights with progress, and noticing files that change meanwhile (no Django).

A ``Plan`` is what was validated when the revision was recorded: the files to hash, each with the
size and modification time it had then. ``hash_plan`` streams them and returns the same digest as
``cachecore.model.digests`` (``checkpoint_digest`` for a checkpoint directory, ``sha256_file`` for a
weights file); a file whose size, modification time or inode differs from the plan's before or after
it is read, or that yields another number of bytes, is ``WeightsChanged``: what was validated is not
what would be served.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachecore.model.digests import manifest_digest, weight_files

CHUNK = 8 << 20
CHECKPOINT, FILE = "checkpoint", "file"


class WeightsChanged(Exception):
    """A file of the plan changed since it was validated (or while it was read)."""


@dataclass(frozen=True)
class Plan:
    """``kind`` (``checkpoint``: ``root`` is a directory, ``files`` its ``config.json`` then its weight
    files; ``file``: ``root`` is the weights file, ``files`` holds ``""``), and each file's
    ``[size, mtime_ns, inode]`` when it was validated."""

    kind: str
    root: str
    files: dict[str, list[int]]

    @property
    def total_bytes(self) -> int:
        return sum(stat[0] for stat in self.files.values())

    def path(self, name: str) -> Path:
        return Path(self.root) / name if name else Path(self.root)

    def to_json(self) -> dict:
        return {"kind": self.kind, "root": self.root, "files": self.files}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(kind=data["kind"], root=data["root"], files={k: list(v) for k, v in data["files"].items()})


def _stat(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def plan_checkpoint(root: Path) -> Plan:
    """The plan of a checkpoint directory (already inspected): ``config.json`` and its weight files."""
    names = ["config.json", *weight_files(root)]
    return Plan(kind=CHECKPOINT, root=str(root), files={name: _stat(root / name) for name in names})


def plan_file(path: Path) -> Plan:
    return Plan(kind=FILE, root=str(path), files={"": _stat(path)})


def _unchanged(plan: Plan, name: str, when: str) -> None:
    try:
        now = _stat(plan.path(name))
    except OSError as exc:
        raise WeightsChanged(f"{name or plan.root} is gone {when} ({exc.strerror})") from None
    if now != plan.files[name]:
        raise WeightsChanged(f"{name or plan.root} changed {when} (size, modification time or inode differ "
                             "from when the revision was recorded)")


def hash_plan(plan: Plan, on_bytes: Callable[[int], None] = lambda n: None) -> str:
    """The digest of ``plan``'s files, streamed; ``on_bytes(n)`` after each chunk with the bytes hashed
    so far (it may block: a pause; or raise: an abort). Raises ``WeightsChanged``, or ``OSError`` for a
    file that cannot be read."""
    done, shas = 0, {}
    for name, (size, _mtime, _ino) in plan.files.items():
        _unchanged(plan, name, "before it was hashed")
        digest, read = hashlib.sha256(), 0
        with plan.path(name).open("rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
                read += len(chunk)
                on_bytes(done + read)
        if read != size:
            raise WeightsChanged(f"{name or plan.root} changed while it was hashed ({read} bytes read, "
                                 f"{size} expected)")
        _unchanged(plan, name, "while it was hashed")
        done += size
        shas[name] = digest.hexdigest()
    if plan.kind == FILE:
        return shas[""]
    config = shas.pop("config.json")
    return manifest_digest(config, shas)
