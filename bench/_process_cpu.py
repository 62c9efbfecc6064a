"""Where a run's CPU went, machine-wide: CPU seconds (user + system) of every process over a block,
and of the threads of watched ones (``bench.engines``: which serving process had the cores).

    with MachineCpu(labels={os.getpid(): "bench"}, watch=("VLLM::Worker",)) as cpu:
        ...
    cpu.busy_cores, cpu.top(4), cpu.engine().threads

Processes that started or ended inside the block count from their first or up to their last
reading; a thread that ended inside the block is not listed (its CPU still counts for its
process). Thread names are the kernel's (``/proc/PID/task/TID/comm``): native threads name
themselves (vLLM's, gloo's), Python 3.11's threads carry their process's name. Shares are of one
core over the block's wall time (``busy_cores`` is their sum: 2.0 on a 2-core machine is every core
busy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil


@dataclass
class ProcessCpu:
    pid: int
    label: str
    seconds: float
    share: float  # of one core over the block
    threads: list[tuple[str, float]] = field(default_factory=list)  # (thread name, share), busiest first


def _label(proc: psutil.Process, labels: dict[int, str]) -> str:
    if proc.pid in labels:
        return labels[proc.pid]
    name = proc.name()
    if name.startswith(("ray::", "VLLM::")) or name in ("raylet", "gcs_server"):
        return name
    cmd = " ".join(proc.cmdline()[1:4])
    return f"{name} {cmd}"[:60]


def _process_times() -> dict[int, tuple[psutil.Process, float]]:
    out = {}
    for proc in psutil.process_iter():
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[proc.pid] = (proc, t.user + t.system)
    return out


def _thread_times(pid: int) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


class MachineCpu:
    """A context manager: after the block, ``processes`` (busiest first, those that spent at least
    ``min_share`` of a core), ``busy_cores`` and ``wall``. ``labels``: names for known pids (this
    process, the client); ``watch``: process names whose threads are also read (the busiest of them
    gets its ``threads`` filled)."""

    def __init__(self, *, labels: dict[int, str] | None = None, watch: tuple[str, ...] = (),
                 min_share: float = 0.01) -> None:
        self.labels = dict(labels or {})
        self.watch = watch
        self.min_share = min_share
        self.processes: list[ProcessCpu] = []
        self.busy_cores = 0.0
        self.wall = 0.0

    def __enter__(self) -> MachineCpu:
        self._before = _process_times()
        self._watched = [pid for pid, (proc, _) in self._before.items() if self._watches(proc)]
        self._threads_before = {pid: _thread_times(pid) for pid in self._watched}
        self._t0 = time.perf_counter()
        return self

    def _watches(self, proc: psutil.Process) -> bool:
        try:
            return proc.name() in self.watch
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def __exit__(self, *exc) -> None:
        after = _process_times()
        threads_after = {pid: _thread_times(pid) for pid in self._watched}
        self.wall = wall = max(time.perf_counter() - self._t0, 1e-9)
        rows = []
        for pid, (proc, seconds) in after.items():
            spent = seconds - self._before.get(pid, (None, 0.0))[1]
            if spent / wall < self.min_share:
                continue
            try:
                label = _label(proc, self.labels)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                label = str(pid)
            row = ProcessCpu(pid, label, spent, spent / wall)
            if pid in threads_after:
                before = self._threads_before[pid]
                per = sorted(((t - before.get(tid, 0.0), tid) for tid, t in threads_after[pid].items()),
                             reverse=True)
                row.threads = [(_thread_name(pid, tid), d / wall) for d, tid in per if d / wall >= self.min_share]
            rows.append(row)
        self.processes = sorted(rows, key=lambda r: r.seconds, reverse=True)
        self.busy_cores = sum(r.share for r in self.processes)

    def top(self, n: int) -> list[ProcessCpu]:
        return self.processes[:n]

    def engine(self) -> ProcessCpu | None:
        """The busiest watched process (the serving engine), or None."""
        return next((r for r in self.processes if r.pid in self._threads_before), None)
