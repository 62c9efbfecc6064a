"""The machine's processes as the supervisor needs them (Linux ``/proc``): parent, process group,
state and start time of each, a process's live descendants, and whether a process or a process group
still runs. Start times tell a reused pid apart from the process seen before. Where there is no
``/proc`` the answers fall back to signal 0 (no descendants are known then)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcInfo:
    ppid: int
    pgid: int
    state: str  # "Z" = zombie (exited, not yet reaped)
    start: int  # start time in clock ticks since boot: tells a reused pid apart


def proc_table() -> dict[int, ProcInfo] | None:
    """Every process from /proc, or None where /proc is not available (then only groups are used)."""
    if not os.path.isdir("/proc/self"):
        return None
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after the command name (which may contain spaces and parentheses).
        rest = stat.rpartition(")")[2].split()
        table[int(entry)] = ProcInfo(ppid=int(rest[1]), pgid=int(rest[2]), state=rest[0], start=int(rest[19]))
    return table


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid`` as {pid: start time}; empty where /proc is not available."""
    table = proc_table() or {}
    children: dict[int, list[int]] = {}
    for p, info in table.items():
        children.setdefault(info.ppid, []).append(p)
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and table[child].state != "Z":
                found[child] = table[child].start
                todo.append(child)
    return found


def alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``start``, is still the process seen then."""
    table = proc_table()
    if table is not None:
        info = table.get(pid)
        return info is not None and info.state != "Z" and (start is None or info.start == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group ``pgid``."""
    table = proc_table()
    if table is not None:
        return any(info.pgid == pgid and info.state != "Z" for info in table.values())
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
