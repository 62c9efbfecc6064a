"""What the operators do during the soak, through the admin API and the console: flush jobs, a rollout
(a new revision, then back), data-key rotation and a shred, admin writes, and reading the console and
the stats. Every job they request is remembered (``jobs``) so the checks can insist each one reached a
final state and was verified.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench._soak.fleet import Admin, Console, job_id

CONSOLE_PAGES = ("/ui/", "/ui/live/", "/ui/charts/cluster.json", "/ui/tenants/")


@dataclass
class Operators:
    admin: Admin
    console: Console
    clock: Callable[[], float]
    say: Callable[[str], None]
    model: str  # the model that is rolled out
    ops_tenant: str
    jobs: dict[int, str] = field(default_factory=dict)  # job id -> what was asked
    console_reads: list[tuple[float, str, int | None]] = field(default_factory=list)
    revisions: list[str] = field(default_factory=lambda: ["r1"])
    admin_writes_lost: int = 0

    def _job(self, body: dict, what: str) -> int:
        jid = job_id(body)
        if jid is None:
            raise RuntimeError(f"{what}: no job in the answer {body}")
        self.jobs[jid] = what
        self.say(f"operator: {what} -> job {jid} at t={self.clock():.1f}s")
        return jid

    async def flush(self, tenant: str) -> int:
        body = await self.admin.ok("POST", "flush-jobs", json={"scope": "tenant", "tenant": tenant,
                                                                "reason": "soak: customer request"})
        return self._job(body, f"flush tenant {tenant}")

    async def rollout(self) -> int:
        """Roll ``model`` to a new revision (created here) on the first call, back to r1 after."""
        if len(self.revisions) == 1:
            await self.admin.ok("POST", f"models/{self.model}/revisions", json={"label": "r2", "seed": 2})
            self.revisions.append("r2")
            body = await self.admin.ok("POST", f"models/{self.model}/rollout",
                                       json={"revision": "r2", "reason": "soak: new weights"})
            return self._job(body, f"rollout {self.model} r2")
        body = await self.admin.ok("POST", f"models/{self.model}/rollout",
                                   json={"revision": "r1", "rollback": True, "confirm": self.model,
                                         "reason": "soak: back"})
        return self._job(body, f"rollback {self.model} r1")

    async def rotate_and_shred(self) -> int:
        """Rotate ``ops_tenant``'s data key, then shred the version it replaced (a job)."""
        old = max(k["version"] for k in (await self.admin.ok("GET", f"tenants/{self.ops_tenant}/data-keys"))
                  if k["state"] == "active")
        await self.admin.ok("POST", f"tenants/{self.ops_tenant}/data-keys/rotate", json={"reason": "soak"})
        body = await self.admin.ok("DELETE", f"tenants/{self.ops_tenant}/data-keys/{old}")
        return self._job(body, f"shred {self.ops_tenant} key v{old}")

    async def admin_writes(self, n: int) -> int:
        """``n`` tenant renames one after another (retried while retryable); how many did not apply."""
        lost, last = 0, ""
        for i in range(n):
            last = f"ops renamed {i}"
            resp = await self.admin.call("PATCH", f"tenants/{self.ops_tenant}", json={"name": last, "reason": "soak"})
            lost += resp.status_code != 200
            await asyncio.sleep(0.1)
        name = None
        for _ in range(20):  # the read that checks the writes: a failed read is recorded, then read again
            resp = await self.admin.call("GET", f"tenants/{self.ops_tenant}")
            if resp.status_code == 200:
                name = resp.json().get("name")
                break
            await asyncio.sleep(0.5)
        lost += name != last
        self.admin_writes_lost += lost
        return lost

    async def read_console(self) -> None:
        for page in CONSOLE_PAGES:
            self.console_reads.append((self.clock(), page, await self.console.read(page)))
        try:
            status = (await self.admin.call("GET", "stats", retry_s=0)).status_code
        except httpx.TransportError:
            status = None
        self.console_reads.append((self.clock(), "/api/admin/stats", status))

    async def console_loop(self, until: float, every: float) -> None:
        while self.clock() < until:
            await self.read_console()
            await asyncio.sleep(every)

    async def job(self, jid: int) -> dict:
        return await self.admin.ok("GET", f"flush-jobs/{jid}")

    async def wait_running(self, jid: int, *, timeout: float) -> dict:
        deadline = self.clock() + timeout
        while True:
            view = await self.job(jid)
            if view["status"] != "queued" or self.clock() > deadline:
                return view
            await asyncio.sleep(0.2)

    async def wait_final(self, *, timeout: float) -> dict[int, dict]:
        """Every requested job's view once all are final, or as they are at ``timeout``."""
        deadline = self.clock() + timeout
        while True:
            views = {jid: await self.job(jid) for jid in self.jobs}
            final = all(v["status"] in ("succeeded", "partial", "failed") for v in views.values())
            if final or self.clock() > deadline:
                return views
            await asyncio.sleep(2)
