"""The supervisor's status file: what ``make run``'s long-running children are doing, for operators.

``$STRATA_HOME/processes.json`` (mode 0600, replaced atomically on every change) holds::

    {"supervisor_pid": 1234, "updated": "2026-12-02T09:30:00Z", "stopping": null | "reason",
     "children": [{"name": "celery", "state": "running" | "restarting" | "waiting" | "stopped" | "crash_loop",
                   "pid": 5678, "restarts": 2, "started": "...Z",
                   "last_exit": {"code": -9, "signal": "SIGKILL", "at": "...Z"} | null,
                   "last_restart": "...Z" | null, "next_start_in_s": 2.0 | null}]}

``waiting``: stopped on purpose until the child it depends on is back (the web server and the Celery
worker while the Ray head restarts). The web process reads the file (``read``) for ``/readyz``'s
operator details and the console; ``running`` there says whether the supervisor that wrote it is alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from workers.proc_table import alive

FILE_NAME = "processes.json"


def path_in(home: Path) -> Path:
    """Where the supervisor of ``$STRATA_HOME`` = ``home`` writes its status."""
    return Path(home) / FILE_NAME


def utc(ts: float | None) -> str | None:
    """``ts`` (seconds since the epoch) as an ISO-8601 UTC string, None stays None."""
    return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def exit_info(returncode: int | None, at: float) -> dict[str, Any]:
    """A child's exit as data: its code, and the signal's name when a signal ended it."""
    sig = None
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            sig = signal.Signals(-returncode).name
    return {"code": returncode, "signal": sig, "at": utc(at)}


def describe_exit(returncode: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` for a log line."""
    info = exit_info(returncode, 0)
    if info["signal"]:
        return f"killed by {info['signal']}"
    return f"exit code {returncode}"


def write(path: Path, children: list[dict[str, Any]], *, stopping: str | None = None) -> None:
    """Replace ``path`` with the current status (a temporary file 0600 renamed over it)."""
    body = {"supervisor_pid": os.getpid(), "updated": utc(time.time()), "stopping": stopping, "children": children}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh, separators=(",", ":"))
    os.replace(tmp, path)


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and alive(pid)


def read(path: Path) -> dict[str, Any] | None:
    """The status at ``path`` with ``running`` (its supervisor process is alive) added; None when there
    is no readable status file (not started by ``make run``)."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("children"), list):
        return None
    body["running"] = _alive(body.get("supervisor_pid"))
    return body
