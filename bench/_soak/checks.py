"""The soak's invariants, as pure functions of what was recorded (samples, fault windows, job views,
audit figures, replica figures): no I/O here, so each is tested on synthetic data
(``tests/test_bench_soak.py``).

A request's outcome (:func:`classify`):

- ``ok``: answered 200 and, when streamed, not ended by an error event;
- ``throttled``: the tenant's own quota (429 with ``Retry-After``, or a ``tenant_busy`` /
  ``inflight_limit`` stream end) for a tenant meant to hit its quotas (``burst``, ``quota``);
- ``stopped``: a ``request_stopped`` answer (503 with ``Retry-After``, or a retryable stream end) to a
  tenant whose running requests the operators stop on purpose (``ops``: its data key is shredded):
  the platform doing what it was asked, so allowed anywhere, and counted;
- ``retryable``: a 429/503 with ``Retry-After``, a retryable stream error event, or, inside a
  ``web_restart`` window only, a refused connection or a cut transfer;
- ``bad``: anything else (a 500, a 503 without ``Retry-After``, a non-retryable stream end...).

Outside every fault window each request must be ``ok`` (or ``throttled``, ``stopped``); inside one,
``retryable`` is allowed too; ``bad`` never is.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._soak.faults import Window
from bench._soak.load import Sample

THROTTLED_PROFILES = frozenset({"burst", "quota"})
STOPPED_PROFILES = frozenset({"ops"})  # the operators shred its data key, which stops its running requests
QUOTA_CODES = frozenset({"tenant_busy", "inflight_limit", "rate_limited"})
ACCEPTED = ("ok", "throttled", "stopped")  # outcomes allowed anywhere
FINAL_JOB_STATES = ("succeeded", "partial", "failed")


@dataclass(frozen=True)
class Invariant:
    name: str
    ok: bool
    detail: str


def covering(sample: Sample, windows: list[Window]) -> list[Window]:
    return [w for w in windows if w.covers(sample.start, sample.end)]


def classify(sample: Sample, windows: list[Window]) -> str:
    if sample.status == 200 and not sample.stream_error:
        return "ok"
    quota = (sample.status == 429 and sample.retry_after) or (sample.stream_error and sample.error in QUOTA_CODES)
    if quota and sample.profile in THROTTLED_PROFILES:
        return "throttled"
    stopped = (sample.status == 503 and sample.retry_after) or (sample.stream_error and sample.stream_retryable)
    if stopped and sample.error == "request_stopped" and sample.profile in STOPPED_PROFILES:
        return "stopped"
    if sample.status in (429, 503) and sample.retry_after:
        return "retryable"
    if sample.stream_error and sample.stream_retryable:
        return "retryable"
    if sample.status is None and any(w.kind == "web_restart" for w in covering(sample, windows)):
        return "retryable"
    return "bad"


@dataclass(frozen=True)
class RequestSummary:
    total: int
    outside: int
    outside_ok: int
    inside: int
    inside_ok: int
    retryable_inside: int
    throttled: int
    stopped: int
    status_500: int
    bad: list[Sample]

    @property
    def outside_ratio(self) -> float:
        return self.outside_ok / self.outside if self.outside else 1.0


def summarize(samples: list[Sample], windows: list[Window]) -> RequestSummary:
    outside = outside_ok = inside = inside_ok = retry_in = throttled = stopped = s500 = 0
    bad: list[Sample] = []
    for s in samples:
        outcome = classify(s, windows)
        in_window = bool(covering(s, windows))
        s500 += s.status is not None and s.status >= 500 and s.status != 503
        throttled += outcome == "throttled"
        stopped += outcome == "stopped"
        if in_window:
            inside += 1
            inside_ok += outcome in ACCEPTED
            retry_in += outcome == "retryable"
            if outcome == "bad":
                bad.append(s)
        else:
            outside += 1
            outside_ok += outcome in ACCEPTED
            if outcome not in ACCEPTED:
                bad.append(s)
    return RequestSummary(len(samples), outside, outside_ok, inside, inside_ok, retry_in, throttled, stopped, s500,
                          bad)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


Percentiles = tuple[int, float | None, float | None]  # (n, p50, p99)


def ttft_by_phase(samples: list[Sample], windows: list[Window], *, warmup_end: float) -> dict[str, Percentiles]:
    """TTFT (n, p50, p99) of the streams that got a first token: ``warm-up``, ``steady`` (outside every
    window) and one phase per fault kind (inside its window)."""
    phases: dict[str, list[float]] = {}
    for s in samples:
        if s.ttft is None:
            continue
        kinds = [w.kind for w in covering(s, windows)]
        phase = "warm-up" if s.start < warmup_end else (kinds[0] if kinds else "steady")
        phases.setdefault(phase, []).append(s.ttft)
    return {p: (len(v), percentile(v, 0.5), percentile(v, 0.99)) for p, v in phases.items()}


def requests_invariant(summary: RequestSummary) -> Invariant:
    worst = ", ".join(sorted({f"{s.kind}:{s.status}:{s.error or '-'}" for s in summary.bad})[:6])
    return Invariant("requests", not summary.bad and summary.status_500 == 0,
                     f"outside windows {summary.outside_ok}/{summary.outside} ok; inside {summary.inside_ok}/"
                     f"{summary.inside} ok, {summary.retryable_inside} retryable; 500s {summary.status_500}"
                     + (f"; bad: {worst}" if summary.bad else ""))


def jobs_invariant(views: dict[int, dict], asked: dict[int, str]) -> Invariant:
    """Every requested job final, succeeded and verified (``attempts`` > 1: finished by a retry)."""
    missing = [j for j in asked if j not in views]
    unfinished = [j for j, v in views.items() if v["status"] not in FINAL_JOB_STATES]
    failed = [f"{j} {v['status']} verified={v.get('verified')} {str(v.get('error') or '')[:120]}".strip()
              for j, v in views.items() if v["status"] in FINAL_JOB_STATES and
              (v["status"] != "succeeded" or not v.get("verified"))]
    retried = [j for j, v in views.items() if int(v.get("attempts") or 0) > 1]
    ok = not (missing or unfinished or failed)
    good = len(views) - len(unfinished) - len(failed)
    detail = f"{len(views)} jobs: {good} succeeded+verified, retried {retried or 'none'}"
    detail += f"; not final {unfinished}" if unfinished else ""
    detail += f"; failed/unverified {failed}" if failed else ""
    detail += f"; missing {missing}" if missing else ""
    return Invariant("jobs", ok, detail)


def audit_invariant(verify: dict, head_line: dict | None) -> Invariant:
    """The chain verifies and its head equals the external head log's last line."""
    if head_line is None:
        return Invariant("audit", False, "no head log line")
    same = (verify.get("head") == head_line.get("hash")
            and int(verify.get("length", -1)) == int(head_line.get("seq", -2)))
    return Invariant("audit", bool(verify.get("ok")) and same,
                     f"verify ok={verify.get('ok')} length={verify.get('length')}; head log seq={head_line.get('seq')}"
                     f" {'==' if same else '!='} head")


def l3_invariant(figures: dict[str, dict], listed: tuple[int, int]) -> Invariant:
    """Every replica's view of the whole L3 store (objects, bytes) equals what the backend holds."""
    objects, used = listed
    wrong = {name: (f.get("store_objects"), f.get("store_used_bytes")) for name, f in figures.items()
             if (f.get("store_objects"), f.get("store_used_bytes")) != (objects, used)}
    capacity = max((int(f.get("capacity_bytes") or 0) for f in figures.values()), default=0)
    detail = f"store holds {objects} objects, {used} bytes"
    detail += f" ({used / capacity:.1f}x one worker's capacity)" if capacity else ""
    detail += f"; replicas agreeing {len(figures) - len(wrong)}/{len(figures)}"
    return Invariant("l3_accounting", bool(figures) and not wrong, detail + (f"; differing {wrong}" if wrong else ""))


def pools_invariant(results: dict[str, str]) -> Invariant:
    """``results``: replica -> "ok" or the integrity error."""
    broken = {k: v for k, v in results.items() if v != "ok"}
    return Invariant("pool_integrity", bool(results) and not broken,
                     f"{len(results) - len(broken)}/{len(results)} replicas intact" + (f"; {broken}" if broken else ""))


def quotas_invariant(loads: dict[str, dict]) -> Invariant:
    """After the run every replica's scheduler is idle: nothing running or waiting is still charged."""
    busy = {k: (v.get("running"), v.get("waiting")) for k, v in loads.items() if v.get("running") or v.get("waiting")}
    return Invariant("quota_counters", bool(loads) and not busy,
                     f"{len(loads) - len(busy)}/{len(loads)} replicas idle with in-flight == running"
                     + (f"; still charged {busy}" if busy else ""))


def greedy_invariant(pairs: list[tuple[str, str]]) -> Invariant:
    """``pairs``: (text during the run, text re-run cold)."""
    differing = sum(a != b for a, b in pairs)
    return Invariant("greedy_identical", bool(pairs) and not differing,
                     f"{len(pairs) - differing}/{len(pairs)} identical re-run cold")


def canary_invariant(own: list[int], foreign: list[int], kv_own: list[int], kv_foreign: list[int]) -> Invariant:
    """Paired: the owner's repeat hits its cache (and its KV upload), nobody else ever does."""
    ok = bool(own) and all(c > 0 for c in own) and all(c == 0 for c in foreign) and \
        all(c > 0 for c in kv_own) and all(c == 0 for c in kv_foreign)
    return Invariant("tenant_isolation", ok,
                     f"owner repeats cached {own}; other tenants' cached_tokens max {max(foreign, default=0)} over "
                     f"{len(foreign)}; KV API owner hits {kv_own}, others max {max(kv_foreign, default=0)}")


def operators_invariant(reads: list[tuple[float, str, int | None]], admin: list[tuple[float, int | None]],
                        windows: list[Window], writes_lost: int) -> Invariant:
    """The operators' side: console pages and admin API answers never a 500 (a 503 or no connection
    only inside a fault window; the admin client retries those), and every admin write applied."""
    def fails(at: float, status: int | None) -> bool:
        if status is not None and status < 500 and status != 429:
            return False
        inside = any(w.covers(at, at) for w in windows)
        return status not in (503, 429, None) or not inside

    bad_reads = [(round(at, 1), page, status) for at, page, status in reads if fails(at, status)]
    bad_admin = [(round(at, 1), status) for at, status in admin if fails(at, status)]
    ok = not bad_reads and not bad_admin and writes_lost == 0
    detail = f"{len(reads)} console/stats reads, {len(admin)} admin answers; admin writes lost {writes_lost}"
    detail += f"; failed reads {bad_reads[:4]}" if bad_reads else ""
    detail += f"; failed admin answers {bad_admin[:4]}" if bad_admin else ""
    return Invariant("operators", ok, detail)


def growth(start: float, end: float) -> float:
    return (end - start) / start if start else 0.0
