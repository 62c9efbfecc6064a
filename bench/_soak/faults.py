"""The fault schedule (:func:`schedule`, pure) and what each fault does (:class:`FaultRunner`).

Each fault is announced with its time on the soak's clock when it starts and when the stack healed;
its *window* (:func:`windows`) runs from its start to its heal plus a grace period, and only inside
a window may a request fail, and then only retryably (``bench._soak.checks``).

Kinds, in schedule order:

- ``replica_kill``: SIGKILL one replica actor's process; healed when the actor answers from a new process
  (the gateway revives it);
- ``redis_stop``: stop the soak's own redis-server (rate-limit counters, L3) for ``hold`` seconds, restart it;
- ``redis_pause``: ``CLIENT PAUSE`` it for ``hold`` seconds;
- ``celery_kill``: request a rollout, SIGKILL the Celery worker while the job runs; healed when the
  launcher has started a new worker (the job is finished by its retry: ``checks.jobs_final``);
- ``web_restart``: SIGTERM the web process; healed when a new one answers ``/healthz``;
- ``pg_terminate``: ``pg_terminate_backend`` on the stack's sessions while an operator writes;
- ``l3_fill``: unique long prompts past L3's capacity (``STRATA_L3_MB``);
- ``l3_corrupt``: flip a byte in a few L3 objects (read and rewritten through L3's own backend class).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

# The Celery kill first: the job it interrupts is resumed once its heartbeat is stale (60 s), within the load.
KINDS = ("celery_kill", "replica_kill", "redis_stop", "redis_pause", "web_restart", "pg_terminate",
         "l3_fill", "l3_corrupt")
HOLD_S = {"redis_stop": (20.0, 8.0), "redis_pause": (5.0, 3.0)}  # (full, quick)


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # seconds on the soak's clock
    hold: float = 0.0


@dataclass
class FaultEvent:
    kind: str
    start: float
    healed: float | None = None  # None: never healed within the timeout
    detail: str = ""


def schedule(load_start: float, duration: float, *, quick: bool, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a run whose load lasts ``duration`` seconds from ``load_start``: spread evenly from
    15% to 80% of the load (the first and last fifth stay quiet: warm-up and recovery), in ``KINDS``
    order, each held for its kind's hold time (shorter with ``quick``)."""
    chosen = [k for k in KINDS if k in kinds]
    if not chosen:
        return []
    first, last = load_start + 0.15 * duration, load_start + 0.80 * duration
    step = (last - first) / max(1, len(chosen) - 1) if len(chosen) > 1 else 0.0
    return [Fault(kind, round(first + i * step, 1), HOLD_S.get(kind, (0.0, 0.0))[1 if quick else 0])
            for i, kind in enumerate(chosen)]


@dataclass(frozen=True)
class Window:
    kind: str
    start: float
    end: float

    def covers(self, start: float, end: float) -> bool:
        return start <= self.end and end >= self.start


def windows(events: list[FaultEvent], *, grace: float, run_end: float) -> list[Window]:
    """Each fault's window: from its start to its heal plus ``grace`` (``run_end`` if it never healed)."""
    return [Window(e.kind, e.start, run_end if e.healed is None else e.healed + grace) for e in events]


@dataclass
class FaultRunner:
    """Executes faults against the stack; ``say`` announces each with its time."""

    stack: object  # bench._soak.stack.Stack
    replicas: object  # bench._soak.replicas.Replicas
    operators: object  # bench._soak.operators.Operators
    traffic: object  # bench._soak.load.Traffic
    clock: Callable[[], float]
    say: Callable[[str], None]
    models: list[str]
    fill_tenant: str
    heal_timeout: float = 120.0
    events: list[FaultEvent] = field(default_factory=list)

    async def run(self, fault: Fault) -> FaultEvent:
        event = FaultEvent(fault.kind, self.clock())
        self.say(f"fault {fault.kind} at t={event.start:.1f}s" + (f" (held {fault.hold:.0f}s)" if fault.hold else ""))
        try:
            event.detail = await getattr(self, f"_{fault.kind}")(fault)
            event.healed = self.clock()
        except Exception as exc:  # reported as a fault that did not heal: the checks fail the run
            event.detail = f"{type(exc).__name__}: {exc}"
        self.events.append(event)
        healed = "not healed" if event.healed is None else f"healed at t={event.healed:.1f}s"
        self.say(f"fault {fault.kind}: {healed}; {event.detail}")
        return event

    async def _until(self, probe, what: str) -> None:
        deadline = self.clock() + self.heal_timeout
        while not await asyncio.to_thread(probe):
            if self.clock() > deadline:
                raise TimeoutError(f"{what} not within {self.heal_timeout:.0f}s")
            await asyncio.sleep(0.5)

    async def _replica_kill(self, fault: Fault) -> str:
        model = self.models[0]
        old = await asyncio.to_thread(self.replicas.pid, model, 1)
        os.kill(old, signal.SIGKILL)

        def revived() -> bool:
            try:
                return self.replicas.pid(model, 1, timeout=5) not in (None, old)
            except Exception:  # dead or not yet restarted
                return False

        await self._until(revived, "replica revived")
        return f"{model}:1 pid {old} killed"

    async def _redis_stop(self, fault: Fault) -> str:
        await asyncio.to_thread(self.stack.redis.stop)
        await asyncio.sleep(fault.hold)
        await asyncio.to_thread(self.stack.redis.start)
        return f"redis-server :{self.stack.redis.port} stopped {fault.hold:.0f}s"

    async def _redis_pause(self, fault: Fault) -> str:
        await asyncio.to_thread(self.stack.redis.pause, fault.hold)
        await asyncio.sleep(fault.hold)
        return f"CLIENT PAUSE {fault.hold:.0f}s"

    async def _celery_kill(self, fault: Fault) -> str:
        job = await self.operators.rollout()
        await self.operators.wait_running(job, timeout=60)
        old = self.stack.roles()["celery"]
        old.send_signal(signal.SIGKILL)
        new = await asyncio.to_thread(self.stack.wait_role, "celery", not_pid=old.pid, timeout=self.heal_timeout)
        if new is None:
            raise RuntimeError(f"no new Celery worker (launcher alive: {self.stack.alive()})")
        return f"celery pid {old.pid} killed during rollout job {job}; restarted as {new.pid}"

    async def _web_restart(self, fault: Fault) -> str:
        old = self.stack.roles()["web"]
        old.send_signal(signal.SIGTERM)
        new = await asyncio.to_thread(self.stack.wait_role, "web", not_pid=old.pid, timeout=self.heal_timeout)
        if new is None:
            raise RuntimeError(f"no new web process (launcher alive: {self.stack.alive()})")
        await self._until(self.stack.healthy, "web /healthz")
        return f"web pid {old.pid} restarted as {new.pid}"

    async def _pg_terminate(self, fault: Fault) -> str:
        writes = asyncio.create_task(self.operators.admin_writes(8))
        killed = 0
        for _ in range(3):
            await asyncio.sleep(0.4)
            killed += await asyncio.to_thread(self.stack.db.terminate)
        lost = await writes
        return f"{killed} sessions terminated during 8 admin writes ({lost} not applied)"

    async def _l3_fill(self, fault: Fault) -> str:
        rng = random.Random(7)
        prompts = [" ".join(f"fill{n}-{rng.randrange(10**6)}" for _ in range(55)) for n in range(12)]
        for i in range(0, len(prompts), 2):
            await asyncio.gather(*(self.traffic.post(self.fill_tenant, "ops", "fill", "/v1/completions",
                                                     {"model": self.models[j % len(self.models)], "prompt": p,
                                                      "max_tokens": 2})
                                   for j, p in enumerate(prompts[i:i + 2])))
        return f"{len(prompts)} unique ~700-token prompts"

    async def _l3_corrupt(self, fault: Fault) -> str:
        def corrupt() -> int:
            backend = self.stack.l3_backend()
            try:
                names = sorted(info.name for info in backend.list())
                done = 0
                for name in random.Random(3).sample(names, min(3, len(names))):
                    data = backend.get(name)
                    if data:
                        mid = len(data) // 2
                        backend.put(name, data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
                        done += 1
                return done
            finally:
                backend.close()

        return f"{await asyncio.to_thread(corrupt)} L3 objects bit-flipped"
