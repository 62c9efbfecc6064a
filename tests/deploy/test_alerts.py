"""Prometheus alert rules (deploy/prometheus/alerts.yml): they load (``promtool check rules``), each
fires and stays silent as its unit tests say (``promtool test rules deploy/prometheus/alerts_test.yml``:
a firing and a silent case for every alert), deploy/prometheus.yml loads them, and every series and
label they read is one Strata's /metrics really exports, with the data that makes it appear produced
the way production produces it (a failed job, a verification of the audit chain, a broken L3
backend, a streamed request through the serving middleware).

promtool comes from Debian's ``prometheus`` package; ``make test`` installs it when it can
(``.ci/ensure-promtool``). Without it these tests skip with one clear line, except under ``CI=true``,
where they fail.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
CONFIG = ROOT / "deploy" / "prometheus.yml"
PROMTOOL_MISSING = ("missing prerequisite: promtool for the alert-rule tests (install it with "
                    "`apt-get install -y prometheus`; `make test` does so when run as root)")
# Labels Prometheus adds itself, or that only exist inside histogram_quantile's buckets.
SCRAPE_LABELS = {"job", "instance", "le"}


def find_promtool() -> str | None:
    """promtool on PATH, else /usr/bin/promtool (where Debian's package puts it)."""
    return shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def promtool_decision(path: str | None, ci: bool) -> tuple[str, str]:
    """``("run", path)`` when promtool is there; otherwise ``("skip", why)`` on a developer's machine
    and ``("fail", why)`` under CI, where the alert-rule tests are required and must not vanish."""
    if path:
        return "run", path
    if ci:
        return "fail", f"{PROMTOOL_MISSING}; CI=true requires it"
    return "skip", PROMTOOL_MISSING


@pytest.fixture(scope="module")
def promtool() -> str:
    verdict, detail = promtool_decision(find_promtool(), in_ci())
    if verdict == "fail":
        pytest.fail(detail, pytrace=False)
    if verdict == "skip":
        pytest.skip(detail)
    return detail


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


# ---------------------------------------------------------------------------------------- promtool
def test_promtool_runs_when_present_skips_outside_ci_and_fails_under_ci():
    assert promtool_decision("/usr/bin/promtool", ci=True) == ("run", "/usr/bin/promtool")
    assert promtool_decision(None, ci=False) == ("skip", PROMTOOL_MISSING)
    verdict, why = promtool_decision(None, ci=True)
    assert verdict == "fail" and "CI=true" in why and "apt-get install -y prometheus" in why


def test_make_test_set_up_names_a_missing_promtool_in_one_line_and_goes_on():
    """.ci/ensure-promtool (the Makefile's test target runs it) agrees with this module's lookup:
    silent when promtool is there, else one line naming it (installing disabled here) and exit 0."""
    env = {**os.environ, "STRATA_INSTALL_PROMTOOL": "0"}
    result = subprocess.run([str(ROOT / ".ci" / "ensure-promtool")], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    if find_promtool():
        assert result.stdout == ""
    else:
        lines = result.stdout.splitlines()
        assert len(lines) == 1 and "missing prerequisite: promtool" in lines[0], result.stdout
    assert ".ci/ensure-promtool" in (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]


def test_the_rules_load(promtool):
    out = _run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout


def test_every_alert_fires_and_stays_silent_as_its_unit_tests_expect(promtool):
    out = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_case_and_a_silent_case():
    """A rule tested only where it fires passes when it always fires; only where it is silent, when
    it never does. Both, for every alert of alerts.yml (and no test of an alert that is not there)."""
    cases: dict[str, set[str]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add("fires" if case.get("exp_alerts") else "silent")
    alerts = {rule["alert"] for rule in _rules()}
    assert set(cases) == alerts
    assert {name: kinds for name, kinds in cases.items() if kinds != {"fires", "silent"}} == {}


def test_the_prometheus_config_loads_the_rules(promtool, tmp_path):
    """deploy/prometheus.yml names the rules by a path relative to itself, and its scrape job is the
    ``job`` the rules select. Checked on a copy whose token file exists (promtool opens it)."""
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == ["prometheus/alerts.yml"]
    assert [job["job_name"] for job in config["scrape_configs"]] == ["strata"]
    assert any('up{job="strata"}' in rule["expr"] for rule in _rules())
    token = tmp_path / "token"
    token.write_text("viewer-token\n")
    shutil.copytree(RULES.parent, tmp_path / "prometheus")
    (tmp_path / "prometheus.yml").write_text(
        CONFIG.read_text().replace("/etc/prometheus/strata-viewer-token", str(token)))
    out = _run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout


# ---------------------------------------------------------------------------------------- the series
def _read_by_rules() -> dict[str, set[str]]:
    """``{alert: labels it selects or groups by}`` and, under the key ``"*"``, every metric name the
    rules read (``up`` is Prometheus's own)."""
    out: dict[str, set[str]] = {"*": set()}
    for rule in _rules():
        expr = rule["expr"]
        out["*"] |= set(re.findall(r"\b(strata_[a-z0-9_]+)", expr))
        labels = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        for matchers in re.findall(r"strata_[a-z0-9_]+\{([^}]*)\}", expr):
            labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
        out[rule["alert"]] = labels - SCRAPE_LABELS
    return out


def _serve_one_stream(status: int, model: str) -> None:
    """One /v1/chat/completions request through the real serving middleware: a streamed response
    (status 200: one token chunk, so a TTFT) or an error body with a code."""
    from controlplane.serving.health import ServingMetrics, note_of

    async def app(scope, receive, send):
        note = note_of(scope)
        note.model, note.stream = model, True
        await send({"type": "http.response.start", "status": status, "headers": []})
        body = b"data: {}\n\n" if status < 400 else b'{"error": {"code": "unavailable"}}'
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message):
        return None

    asyncio.run(ServingMetrics(app)({"type": "http", "path": "/v1/chat/completions"}, receive, send))


@pytest.fixture
def broken_l3_row(tmp_path):
    """The L3 row of a replica whose L3 backend just failed: a real store's figures."""
    from cachecore.crypto import Keyring, generate_key
    from cachecore.layout import KVLayout
    from cachecore.tiers.backends.fs import FileBackend
    from cachecore.tiers.remote import RemoteStore, l3_figures

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    root = tmp_path / "l3"
    keyring = Keyring()
    keyring.add("t1", 1, generate_key())
    store = RemoteStore(FileBackend(root), keyring, layout, chunk_blocks=4, refresh_seconds=0.0)
    store.gauges()
    root.rename(tmp_path / "l3.away")
    root.write_bytes(b"not a directory")  # the mount is gone: every call fails
    return l3_figures(store.gauges(), store.chunk_blocks, layout.bytes_per_block)


def _snapshot(l3_row: dict) -> dict:
    """``stats.cluster_stats()`` with two replicas of one model: 0 answers (its L3 row broken), 1 is
    down (started, not answering)."""
    ok = {"model": "m1", "replica": 0, "status": "ok", "pool": {"free": 8}, "usage": [],
          "tiers": {"l3": l3_row}, "resident_bytes": {}}
    return {"workers": [ok, {"model": "m1", "replica": 1, "status": "unreachable"}]}


@pytest.mark.django_db
def test_every_series_and_label_the_rules_read_is_exported(actor, admin_client, monkeypatch, broken_l3_row):
    from controlplane.audit.checks import audit_check_run
    from controlplane.audit.services import audit_record
    from controlplane.jobs import services as jobs
    from controlplane.jobs.models import FlushJob
    from controlplane.runtime import stats

    monkeypatch.setattr(stats, "cluster_stats", lambda: _snapshot(broken_l3_row))
    job = FlushJob.objects.create(kind=FlushJob.Kind.FLUSH, scope=FlushJob.Scope.ALL, reason="test",
                                  requested_by="tests")
    jobs.job_fail(job_id=job.pk, error="RuntimeError: every retry failed")
    audit_record(actor=actor, action="test.event", target="t")
    audit_check_run()
    _serve_one_stream(200, "m1")
    _serve_one_stream(503, "m1")

    text = admin_client.get("/metrics").content.decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    exported = {s.name for s in samples}
    read = _read_by_rules()
    assert read["*"] - exported == set()
    for alert, labels in read.items():
        if alert == "*":
            continue
        metrics = set(re.findall(r"\b(strata_[a-z0-9_]+)", next(r["expr"] for r in _rules() if r["alert"] == alert)))
        carried = {label for s in samples if s.name in metrics for label in s.labels}
        assert labels - carried == set(), alert
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert value[("strata_tier_breaker_open", (("model", "m1"), ("replica", "0"), ("tier", "l3")))] == 1.0
    assert value[("strata_worker_up", (("model", "m1"), ("replica", "1")))] == 0.0
    assert value[("strata_jobs_finished_total", (("kind", "flush"), ("status", "failed")))] == 1.0
    assert value[("strata_audit_verify_ok", ())] == 1.0


@pytest.mark.django_db
def test_a_failed_job_counts_once_under_its_kind_and_status_and_every_pair_starts_at_zero(admin_client):
    from controlplane.jobs import services as jobs
    from controlplane.jobs.models import FlushJob

    def finished() -> dict[tuple[str, str], float]:
        text = admin_client.get("/metrics").content.decode()
        return {(s.labels["kind"], s.labels["status"]): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "strata_jobs_finished_total"}

    before = finished()
    assert set(before) == {(k, str(s)) for k in FlushJob.Kind.values for s in FlushJob.FINAL}
    assert set(before.values()) == {0.0}  # listed from 0: the first failure is an increase
    shred = FlushJob.objects.create(kind=FlushJob.Kind.SHRED, scope=FlushJob.Scope.ALL, reason="test",
                                    requested_by="tests")
    jobs.job_fail(job_id=shred.pk, error="boom")
    jobs.job_fail(job_id=shred.pk, error="boom again")  # a final job is never touched again
    FlushJob.objects.create(kind=FlushJob.Kind.FLUSH, scope=FlushJob.Scope.ALL, reason="test",
                            requested_by="tests", status=FlushJob.Status.SUCCEEDED)
    FlushJob.objects.create(kind=FlushJob.Kind.FLUSH, scope=FlushJob.Scope.ALL, reason="test",
                            requested_by="tests", status=FlushJob.Status.RUNNING)  # not final: not counted
    after = finished()
    assert after[("shred", "failed")] == 1.0 and after[("flush", "succeeded")] == 1.0
    assert after[("flush", "failed")] == 0.0 and sum(after.values()) == 2.0
