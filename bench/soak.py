"""The platform under steady load while faults happen, checked afterwards for what was lost.

    .venv/bin/python -m bench.soak            # about 15 minutes
    .venv/bin/python -m bench.soak --quick    # about 3 minutes on a 2-core machine (CI)

It starts ``make run``'s real stack (``bench._soak.stack``: PostgreSQL database ``strata_soak``, its own
redis-server for rate limits and L3, Celery on the machine's Redis), creates two models with two
replicas each and six tenants with different quotas and weights through the admin API, then for
``--duration`` seconds runs the tenants' traffic (``bench._soak.load``), the operators' jobs and console
reads (``bench._soak.operators``) and the fault schedule (``bench._soak.faults``), each fault announced
with its time. Afterwards it checks (``bench._soak.checks``): requests (never a 500; outside fault
windows every request succeeds; inside only retryable failures), tenant isolation by canary prompts and
the KV API, greedy outputs re-run cold, every job final and verified, the audit chain against its
external head log, L3 accounting against the objects present, every replica's pool integrity and
in-flight accounting, and the processes' RSS, file descriptors and threads. One table, one ``RESULT``
line; exit 1 when an invariant (not a latency or a resource goal) is broken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import sys
import time
from pathlib import Path

import psutil

from bench._soak import checks
from bench._soak.faults import KINDS, FaultRunner, schedule, windows
from bench._soak.fleet import Admin, Console, create_fleet, tenant_specs
from bench._soak.load import Traffic, monotonic_clock
from bench._soak.operators import Operators
from bench._soak.replicas import Replicas
from bench._soak.report import result_line, table
from bench._soak.stack import Stack, StackConfig

REPLICAS = 2
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[soak {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def model_bodies(home: Path, *, vllm: bool) -> list[dict]:
    """Two models, two replicas each: ``soak-a`` on Strata's engine (rolled out during the run) and
    ``soak-b`` on vLLM (a tiny checkpoint, as the tests build it) when ``vllm``, else Strata's engine."""
    bodies = [{"name": "soak-a", "preset": "tiny", "revision": {"label": "r1", "seed": 1}, "replicas": REPLICAS}]
    if vllm:
        from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

        ckpt = home / "ckpt-vllm"
        build_checkpoint("llama", ckpt, seed=11, max_pos=2048, **VLLM_CPU_SHAPE)
        bodies.append({"name": "soak-b", "engine": "vllm", "revision": {"label": "r1", "path": str(ckpt)},
                       "replicas": REPLICAS})
    else:
        bodies.append({"name": "soak-b", "preset": "tiny", "revision": {"label": "r1", "seed": 5},
                       "replicas": REPLICAS})
    return bodies


def resources(stack: Stack, replicas: Replicas, models: list[str]) -> dict[str, dict]:
    """RSS, open fds and threads of the web process, the Celery worker and every replica actor."""
    procs = {name: p for name, p in stack.roles().items() if name in ("web", "celery")}
    for model in models:
        for r in range(REPLICAS):
            try:
                pid = replicas.pid(model, r, timeout=10)
                if pid:
                    procs[f"{model}:{r}"] = psutil.Process(pid)
            except Exception as exc:  # reported as a missing row
                say(f"resources: {model}:{r}: {type(exc).__name__}")
    out = {}
    for name, proc in procs.items():
        try:
            with proc.oneshot():
                out[name] = {"rss": proc.memory_info().rss, "fds": proc.num_fds(), "threads": proc.num_threads(),
                             "pid": proc.pid}
        except psutil.Error:
            continue
    return out


async def wait_ready(traffic: Traffic, tenants: list[str], models: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for model in models:
        while True:
            _, data = await traffic.post(tenants[0], "setup", "complete", "/v1/completions",
                                         {"model": model, "prompt": "warm up", "max_tokens": 2})
            if data is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"model {model} not serving within {timeout:.0f}s")
            await asyncio.sleep(2)
    traffic.samples.clear()  # set-up requests (replicas still starting) are not part of the soak


async def canaries(traffic: Traffic, owner: str, others: list[str], models: list[str], tag: str) -> tuple[list, list]:
    """The owner sends a fresh prompt twice (the repeat must hit), every other tenant once (must not)."""
    own, foreign = [], []
    for model in models:
        prompt = f"Canary {tag} {secrets.token_hex(8)}: " + "only its owner may ever reuse this prefix. " * 8
        body = {"model": model, "prompt": prompt, "max_tokens": 2}
        await traffic.post(owner, "canary", "complete", "/v1/completions", body)
        s, data = await traffic.post(owner, "canary", "complete", "/v1/completions", body)
        own.append(s.cached_tokens or 0)
        for other in others:
            s, data = await traffic.post(other, "canary", "complete", "/v1/completions", body)
            if data is not None:
                foreign.append(s.cached_tokens or 0)
    return own, foreign


async def operator_plan(ops: Operators, specs, clock, load_start: float, duration: float, rollout: bool) -> None:
    plan = [(0.25, lambda: ops.flush(specs["chat"])), (0.5, ops.rotate_and_shred),
            (0.7, lambda: ops.flush(specs["steady"]))]
    if rollout:
        plan.append((0.45, ops.rollout))
    for frac, action in sorted(plan, key=lambda p: p[0]):
        await asyncio.sleep(max(0.0, load_start + frac * duration - clock()))
        try:
            await action()
        except Exception as exc:  # the job is then missing: the jobs invariant names it
            say(f"operator action failed: {type(exc).__name__}: {exc}")


async def fault_plan(runner: FaultRunner, plan, clock) -> None:
    for fault in plan:
        await asyncio.sleep(max(0.0, fault.at - clock()))
        await runner.run(fault)


def l3_listing(stack: Stack) -> tuple[int, int]:
    """(objects, bytes) in the L3 store, listed through its own backend class."""
    backend = stack.l3_backend()
    try:
        infos = list(backend.list())
    finally:
        backend.close()
    return len(infos), sum(info.size for info in infos)


def head_log(home: Path) -> dict | None:
    lines = []
    for path in sorted(home.glob("audit-head*.log")):
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                continue
    return max(lines, key=lambda line: int(line.get("seq", -1)), default=None)


async def after_run(stack, replicas, traffic, ops, admin, specs, models, names) -> list[checks.Invariant]:
    """The checks that need the stack, once the load has stopped."""
    invariants = []
    views = await ops.wait_final(timeout=180)
    invariants.append(checks.jobs_invariant(views, ops.jobs))

    say(f"jobs final ({len(views)}); canaries")
    owner, others = specs["steady"], [specs[p] for p in ("chat", "burst", "kv", "ops")]
    own, foreign = await canaries(traffic, owner, others, names, "end")
    kv_model = names[-1]  # names[0] was rolled out: KV stored under its old revision is gone by design
    kv_tokens = [secrets.randbelow(250) + 1 for _ in range(2 * 16 + 3)]
    await traffic.kv_store(specs["kv"], kv_model, kv_tokens)
    kv_own = [await traffic.kv_hits(specs["kv"], kv_model, kv_tokens) or 0]
    kv_foreign = [await traffic.kv_hits(o, kv_model, kv_tokens) or 0 for o in others if o != specs["kv"]]
    say("greedy re-runs")
    invariants.append(checks.canary_invariant(own + traffic_canaries.get("own", []),
                                              foreign + traffic_canaries.get("foreign", []), kv_own, kv_foreign))

    pairs = []
    for g in [g for g in traffic.greedy if g.model != names[0]][:12]:  # soak-a was rolled out meanwhile
        _, data = await traffic.post(g.tenant, "rerun", "complete", "/v1/completions",
                                     {"model": g.model, "prompt": g.prompt, "max_tokens": traffic.max_tokens,
                                      "temperature": 0, "cache_salt": f"cold-{secrets.token_hex(6)}"})
        if data is not None:
            pairs.append((g.text, data["choices"][0]["text"]))
    invariants.append(checks.greedy_invariant(pairs))
    say("replicas: drain, integrity, stats")

    pools, loads, l3 = {}, {}, {}
    for model in names:
        for r in range(REPLICAS):
            name = f"{model}:{r}"
            try:
                await asyncio.to_thread(replicas.call, model, r, "drain_writes", timeout=120)
                await asyncio.to_thread(replicas.call, model, r, "check_integrity", timeout=120)
                pools[name] = "ok"
                stats = await asyncio.to_thread(replicas.call, model, r, "stats", timeout=60)
                loads[name] = stats.get("scheduler", {})
            except Exception as exc:
                pools[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    invariants += [checks.pools_invariant(pools), checks.quotas_invariant(loads)]

    say("L3 accounting")
    deadline = time.monotonic() + 45  # replicas list the store again when their index is 30 s old
    while True:
        listed = await asyncio.to_thread(l3_listing, stack)
        for model in names:
            for r in range(REPLICAS):
                try:
                    stats = await asyncio.to_thread(replicas.call, model, r, "stats", timeout=60)
                    l3[f"{model}:{r}"] = stats.get("tiers", {}).get("l3") or {}
                except Exception as exc:
                    l3[f"{model}:{r}"] = {"error": type(exc).__name__}
        inv = checks.l3_invariant({k: v for k, v in l3.items() if "store_objects" in v or "error" in v}, listed)
        if inv.ok or time.monotonic() > deadline:
            break
        await asyncio.sleep(5)
    invariants.append(inv)

    verify = await admin.ok("GET", "audit/verify")
    invariants.append(checks.audit_invariant(verify, head_log(stack.home)))
    return invariants


traffic_canaries: dict[str, list[int]] = {}


async def soak(args) -> int:
    kinds = tuple(k for k in KINDS if k not in set(args.skip))
    # SIGTERM (CI's timeout, an operator) cancels the run; the finally below still stops the stack.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    stack = Stack(StackConfig(db=args.db, broker_db=args.broker_db, l3_mb=1 if args.quick else 2))
    say(f"starting make run's stack (STRATA_HOME {stack.home}, web :{stack.web_port}, ray :{stack.ray_port}, "
        f"redis :{stack.redis.port}, database {args.db})")
    failed_setup = True
    try:
        await asyncio.to_thread(stack.start)
        say("stack up")
        token = stack.manage("create_operator_token", "--username", "soak", "--role", "admin").strip().splitlines()[-1]
        console = Console(stack.url)
        stack.manage("createsuperuser", "--noinput", "--username", "soak-staff", "--email", "soak@example.invalid",
                     env={"DJANGO_SUPERUSER_PASSWORD": console.password})
        clock = monotonic_clock()
        admin = Admin(stack.url, token, clock)
        bodies = model_bodies(stack.home, vllm=args.vllm)
        names = [b["name"] for b in bodies]
        run_id = secrets.token_hex(2)
        spec_list = tenant_specs(run_id)
        specs = {s.profile: s.slug for s in spec_list}
        keys = await create_fleet(admin, spec_list, bodies)
        await console.login("soak-staff")
        say(f"models {names} ({', '.join(b.get('engine', 'strata') for b in bodies)}, {REPLICAS} replicas each), "
            f"tenants {[s.slug for s in spec_list]}")
        replicas = Replicas(ray_port=stack.ray_port, home=stack.home)  # main thread: Ray sets signal handlers
        traffic = Traffic(stack.url, keys, names, clock)
        await wait_ready(traffic, [specs["steady"]], names, timeout=600 if args.vllm else 240)
        say("every model serves")
        kv_tokens = list(range(10, 10 + 2 * 16 + 3))
        await traffic.kv_store(specs["kv"], names[-1], kv_tokens)
        own, foreign = await canaries(traffic, specs["steady"], [specs[p] for p in ("chat", "burst", "kv", "ops")],
                                      names, "start")
        traffic_canaries.update(own=own, foreign=foreign)
        traffic.samples.clear()
        failed_setup = False

        ops = Operators(admin, console, clock, say, names[0], specs["ops"])
        runner = FaultRunner(stack, replicas, ops, traffic, clock, say, names, specs["ops"])
        load_start = clock()
        until = load_start + args.duration
        plan = schedule(load_start, args.duration, quick=args.quick, kinds=kinds)
        say(f"load for {args.duration:.0f}s; fault schedule: "
            + ", ".join(f"{f.kind}@{f.at:.0f}s" for f in plan))
        warm_at = load_start + 0.12 * args.duration
        start_res: dict = {}

        async def sample_start() -> None:
            await asyncio.sleep(max(0.0, warm_at - clock()))
            start_res.update(await asyncio.to_thread(resources, stack, replicas, names))

        paces = {"steady": 0.3, "chat": 0.6, "burst": 1.0, "quota": 0.5, "kv": 1.0, "ops": 2.0}
        loops = [traffic.run(s.slug, s.profile, until, seed=i, pace=paces[s.profile]) for i, s in enumerate(spec_list)]
        async with asyncio.TaskGroup() as group:  # one failing part cancels the others
            for coro in (*loops, sample_start(), ops.console_loop(until, 5 if args.quick else 15),
                         operator_plan(ops, specs, clock, load_start, args.duration, "celery_kill" not in kinds),
                         fault_plan(runner, plan, clock)):
                group.create_task(coro)
        load_end = clock()
        say(f"load done ({len(traffic.samples)} requests); checking")
        if not stack.alive():
            raise RuntimeError(f"the stack stopped during the run:\n{stack.log_tail()}")
        invariants = await after_run(stack, replicas, traffic, ops, admin, specs, bodies, names)
        end_res = await asyncio.to_thread(resources, stack, replicas, names)

        wins = windows(runner.events, grace=5 if args.quick else 10, run_end=load_end)
        soak_samples = [s for s in traffic.samples if s.profile not in ("canary", "rerun")]
        summary = checks.summarize(soak_samples, wins)
        healed = sum(e.healed is not None for e in runner.events)
        invariants = [checks.requests_invariant(summary),
                      checks.Invariant("faults_healed", healed == len(plan), f"{healed}/{len(plan)} healed"),
                      checks.operators_invariant(ops.console_reads, [(a.at, a.status) for a in admin.answers],
                                                 wins, ops.admin_writes_lost),
                      *invariants,
                      checks.Invariant("stack_alive", stack.alive() and stack.healthy(),
                                       "launcher running, /healthz 200")]
        ttft = checks.ttft_by_phase(soak_samples, wins, warmup_end=warm_at)
        rows = [(name, start_res.get(name, {}), end_res.get(name, {}))
                for name in sorted(set(start_res) | set(end_res))]
        grow = {name.replace(":", "_").replace("-", "_"): checks.growth(s["rss"], e["rss"]) for name, s, e in rows
                if s and e and s.get("pid") == e.get("pid")}
        engines = ", ".join(f"{b['name']}:{b.get('engine', 'strata')}" for b in bodies)
        setup = (f"make run stack (PostgreSQL db {args.db}, own redis-server for REDIS_URL and L3, Celery on "
                 f"redis 6379/{args.broker_db}); models {engines}"
                 f" x{REPLICAS} replicas; {len(spec_list)} tenants; load {args.duration:.0f}s"
                 + (f"; skipped faults {sorted(set(args.skip))}" if args.skip else "")
                 + ("; vLLM installed but left out (--quick: its replicas start too slowly on 2 cores; --vllm "
                    "forces it)" if not args.vllm and vllm_installed() else ""))
        print(table(setup=setup, faults=runner.events, summary=summary, ttft=ttft, resources=rows,
                    invariants=invariants), flush=True)
        print("RSS growth goal < 10% after warm-up (same process; a restarted one is not compared): "
              + (", ".join(f"{k} {v:+.1%}" for k, v in grow.items()) or "no process lived through the run"),
              flush=True)
        if args.samples:
            args.samples.write_text("".join(json.dumps(vars(s)) + "\n" for s in traffic.samples))
        print(result_line(summary=summary, ttft=ttft, faults=runner.events, invariants=invariants, rss_growth=grow,
                          duration=time.monotonic() - T0), flush=True)
        await asyncio.gather(traffic.close(), admin.close(), console.close())
        await asyncio.to_thread(replicas.close)
        return 0 if all(i.ok for i in invariants) else 1
    except Exception as exc:
        say(f"soak aborted: {type(exc).__name__}: {exc}")
        print(f"RESULT ok=False aborted={'setup' if failed_setup else 'run'}", flush=True)
        return 1
    finally:
        keep = args.keep
        await asyncio.to_thread(stack.stop, keep_home=keep)
        say("stack stopped" + (f"; state kept in {stack.home}" if keep else ", database dropped"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 3 minutes: shorter load and fault holds")
    ap.add_argument("--duration", type=float, default=None, help="load seconds (default 720; --quick 60)")
    ap.add_argument("--skip", action="append", default=[], choices=KINDS, help="leave out a fault kind (repeatable)")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                    help="soak-b on vLLM (default: when vLLM is installed, not with --quick)")
    ap.add_argument("--db", default="strata_soak", help="PostgreSQL database created and dropped by the soak")
    ap.add_argument("--broker-db", type=int, default=12, help="db number of the Celery broker on redis 6379")
    ap.add_argument("--keep", action="store_true", help="keep STRATA_HOME (logs) after the run")
    ap.add_argument("--samples", type=Path, default=None, help="write every request's sample here (JSON lines)")
    args = ap.parse_args(argv)
    args.duration = args.duration or (60.0 if args.quick else 720.0)
    if args.vllm is None:
        args.vllm = vllm_installed() and not args.quick
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
