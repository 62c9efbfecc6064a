"""bench.routing_live --quick runs end to end (2 real replicas, both policies) and prints its table
and RESULT line; no figure is asserted (a shared, noisy machine), only that every request was served
and the benchmark's own checks (policy decisions, replica counters) held."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_live_routing_prints_both_policies_and_a_result_line():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STRATA_RAY_ADDRESS", "DATABASE_URL")}
    out = subprocess.run([sys.executable, "-m", "bench.routing_live", "--quick", "--quiet"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["round_robin"], ["strata"])}
    assert set(rows) == {"round_robin", "strata"}
    assert all(row[2] == "0" for row in rows.values()), rows  # no request failed
    result = lines[-1]
    assert result.startswith("RESULT replicas=2 ") and "strata_hit=" in result and "failed=0" in result
