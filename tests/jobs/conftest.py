"""Fixtures for job tests: a real Celery worker subprocess on the same broker, database and Ray
cluster as the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from tests.live_db import database_url
from tests.serving.conftest import asgi_url, engine_platform, platform, ray_cluster  # noqa: F401  (re-exported)

REPO = Path(__file__).resolve().parents[2]


class CeleryWorker:
    def __init__(self, ray_address: str, step_delay: float) -> None:
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.test_worker",
            "DATABASE_URL": database_url(),
            "RAY_ADDRESS": ray_address,
            "STRATA_TEST_JOB_STEP_DELAY": str(step_delay),
            "STRATA_TEST_JOB_STALE_SECONDS": "2",
            "STRATA_TEST_CELERY_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
            "STRATA_TEST_ROLLOUT_DRAIN_SECONDS": "0.5",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
        }
        if settings.CELERY_BROKER_URL:
            self.env["CELERY_BROKER_URL"] = settings.CELERY_BROKER_URL
        self.proc: subprocess.Popen | None = None
        self.log = REPO / ".strata" / "test" / f"celery-{os.getpid()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            # threads pool (as `make run` uses): the consumer keeps serving the broker while a task
            # runs, which the Redis transport needs during a long job
            [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker", "--pool", "threads",
             "--concurrency", "1", "--loglevel", "info", "--without-gossip", "--without-mingle", "--without-heartbeat"],
            env=self.env, cwd=REPO, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self) -> None:
        """SIGKILL: the crash a job must survive (no chance to ack, release or clean up)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def celery_worker_factory(ray_cluster):  # noqa: F811
    from controlplane.celery_app import app

    app.control.purge()  # messages left by earlier runs on a shared broker must not run here
    started: list[CeleryWorker] = []

    def make(step_delay: float = 0.0) -> CeleryWorker:
        worker = CeleryWorker(ray_cluster, step_delay)
        worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


def wait_for(predicate, timeout: float = 120.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")
