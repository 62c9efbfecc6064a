"""The soak's table and its ``RESULT`` line."""

from __future__ import annotations

from bench._soak.checks import Invariant, RequestSummary
from bench._soak.faults import FaultEvent


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(*, setup: str, faults: list[FaultEvent], summary: RequestSummary,
          ttft: dict[str, tuple[int, float | None, float | None]], resources: list[tuple[str, dict, dict]],
          invariants: list[Invariant]) -> str:
    lines = [f"setup: {setup}", "", "faults (soak clock, seconds):",
             f"  {'fault':<14}{'start':>8}{'healed':>9}  detail"]
    for e in faults:
        healed = "never" if e.healed is None else f"{e.healed:.1f}"
        lines.append(f"  {e.kind:<14}{e.start:>8.1f}{healed:>9}  {e.detail}")
    lines += ["", f"requests: {summary.total} (throttled by own quota: {summary.throttled}; "
                      f"stopped by a key shred: {summary.stopped})",
              f"  outside fault windows: {summary.outside_ok}/{summary.outside} ok ({summary.outside_ratio:.2%})",
              f"  inside fault windows:  {summary.inside_ok}/{summary.inside} ok, {summary.retryable_inside} retryable",
              "", f"  {'phase':<14}{'streams':>8}{'TTFT p50 ms':>13}{'p99 ms':>9}"]
    for phase, (n, p50, p99) in sorted(ttft.items()):
        lines.append(f"  {phase:<14}{n:>8}{_ms(p50):>13}{_ms(p99):>9}")
    lines += ["", f"  {'process':<18}{'RSS MiB start':>14}{'end':>8}{'growth':>8}{'fds':>10}{'threads':>12}"]
    for name, start, end in resources:
        rss0, rss1 = start.get("rss", 0) / 2**20, end.get("rss", 0) / 2**20
        grow = f"{(rss1 - rss0) / rss0:+.0%}" if rss0 and rss1 else "-"
        if start.get("pid") != end.get("pid"):
            grow = "restart"  # another process by the end: not a growth
        lines.append(f"  {name:<18}{rss0:>14.0f}{rss1:>8.0f}{grow:>8}"
                     f"{start.get('fds', '-')!s:>5}->{end.get('fds', '-')!s:<4}"
                     f"{start.get('threads', '-')!s:>6}->{end.get('threads', '-')!s:<4}")
    lines += ["", "invariants:"]
    for inv in invariants:
        lines.append(f"  [{'ok' if inv.ok else 'BROKEN'}] {inv.name}: {inv.detail}")
    return "\n".join(lines)


def result_line(*, summary: RequestSummary, ttft: dict, faults: list[FaultEvent], invariants: list[Invariant],
                rss_growth: dict[str, float], duration: float) -> str:
    steady = ttft.get("steady", (0, None, None))
    parts = [f"ok={all(i.ok for i in invariants)}", f"duration_s={duration:.0f}", f"requests={summary.total}",
             f"outside_ok_ratio={summary.outside_ratio:.4f}", f"inside_retryable={summary.retryable_inside}",
             f"status_500={summary.status_500}", f"faults={len(faults)}",
             f"faults_healed={sum(e.healed is not None for e in faults)}",
             f"ttft_steady_p50_ms={_ms(steady[1])}", f"ttft_steady_p99_ms={_ms(steady[2])}"]
    parts += [f"{name}_rss_growth={g:+.3f}" for name, g in rss_growth.items()]
    parts += [f"{inv.name}={'ok' if inv.ok else 'broken'}" for inv in invariants]
    return "RESULT " + " ".join(parts)
