"""Weight digests off the request: ``digest_now_or_later`` hashes small weights on the spot (at most
``STRATA_DIGEST_INLINE_BYTES``, a few tens of milliseconds) and leaves a bigger revision's digest
``""`` (pending); ``hash_later`` records it (``WeightHash``, in the caller's transaction) and hashes it
in a thread of this process once committed (``hash_run``). When the digest lands on the revision, the
deployment's replicas start (``runtime.warm``) if it is the active revision. Until then the gateway
holds the revision (``selectors.hold``): tenants get 503 ``model_starting``, no replica starts, no
rollout goes to it.

Crashes: a hash holds a lease, ``owner`` plus a heartbeat renewed at least every ``HEARTBEAT_S``
while it runs (also while the test hook ``STRATA_DIGEST_PAUSE_FILE`` pauses it). A hash whose
heartbeat is older than ``STRATA_DIGEST_STALE_SECONDS`` (its process died, or its thread failed) is
taken over from the start by ``resume_stale``, which every web process runs from its start and then
every half window (``start_at_startup``). A hash that loses its lease stops without writing.

A revision or deployment deleted meanwhile (a row gone, or hidden by its manager) ends its hash: the
heartbeat finds no live row and stops (``LeaseLost``), ``resume_stale`` drops such rows, and nothing
lands for it.

Failures are final and visible: a file that changed since it was validated, or that cannot be read,
leaves the row ``failed`` with the reason (the revision never serves; add a new revision), audited
``revision.digest_failed``; a digest that lands is audited ``revision.digest``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.hashing.hasher import Plan, WeightsChanged, hash_plan
from controlplane.hashing.models import WeightHash
from controlplane.registry.models import ModelDeployment, ModelRevision

logger = logging.getLogger("controlplane.hashing")

INLINE_BYTES = 64 << 20  # default of STRATA_DIGEST_INLINE_BYTES: ~60 ms of SHA-256
STALE_SECONDS = 30.0  # default of STRATA_DIGEST_STALE_SECONDS
HEARTBEAT_S = 1.0
ACTOR = Actor.system("hasher")


class LeaseLost(Exception):
    """Another process took this hash over (this one was presumed dead), or its revision was deleted."""


def _live() -> Q:
    """Hashes of revisions that still exist, of deployments that still exist (the registry's default
    managers hide deleted rows)."""
    live = ModelRevision.objects.filter(deployment__in=ModelDeployment.objects.all())
    return Q(revision__in=live.values("pk"))


def inline_bytes() -> int:
    return int(getattr(settings, "STRATA_DIGEST_INLINE_BYTES", INLINE_BYTES))


def stale_seconds() -> float:
    return float(getattr(settings, "STRATA_DIGEST_STALE_SECONDS", STALE_SECONDS))


def digest_now_or_later(plan: Plan) -> str:
    """``plan``'s digest when its files are small enough to hash on the request, else ``""`` (pending:
    pass the plan to ``hash_later`` with the revision). Raises ``WeightsChanged`` or ``OSError``."""
    return hash_plan(plan) if plan.total_bytes <= inline_bytes() else ""


def _owner() -> str:
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def hash_later(*, revision: ModelRevision, plan: Plan) -> WeightHash:
    """Inside the transaction that created ``revision`` (digest ``""``): record its hash, leased to this
    process, and start it in a thread once the transaction commits."""
    owner = _owner()
    row = WeightHash.objects.create(revision=revision, plan=plan.to_json(), total_bytes=plan.total_bytes,
                                    owner=owner, heartbeat_at=timezone.now(), attempts=1)
    transaction.on_commit(lambda: _start(revision.pk, owner))
    return row


def _start(revision_id: int, owner: str) -> threading.Thread:
    thread = threading.Thread(target=hash_run, kwargs={"revision_id": revision_id, "owner": owner},
                              name=f"hash-revision-{revision_id}", daemon=True)
    thread.start()
    return thread


class _Beat:
    """``hash_plan``'s progress callback: renews the lease with the bytes done at most every
    ``HEARTBEAT_S``, and waits while the pause hook's file exists (renewing it meanwhile)."""

    def __init__(self, revision_id: int, owner: str) -> None:
        self.revision_id, self.owner, self.last = revision_id, owner, 0.0
        self.pause = getattr(settings, "STRATA_DIGEST_PAUSE_FILE", None)

    def __call__(self, done: int) -> None:
        self.renew(done, force=False)
        while self.pause and os.path.exists(self.pause):
            time.sleep(0.05)
            self.renew(done, force=False)

    def renew(self, done: int, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self.last < HEARTBEAT_S:
            return
        self.last = now
        if not WeightHash.objects.filter(_live(), pk=self.revision_id, owner=self.owner,
                                         state=WeightHash.State.HASHING) \
                .update(done_bytes=done, heartbeat_at=timezone.now()):
            raise LeaseLost(self.revision_id)


def hash_run(*, revision_id: int, owner: str) -> str:
    """Hash revision ``revision_id``'s weights under the lease ``owner`` holds, then record the digest
    (``ready``) or the failure (``failed``); ``lost`` when the lease went to another process. Blocking;
    runs in its own thread (and closes its database connection)."""
    try:
        row = WeightHash.objects.filter(pk=revision_id, owner=owner, state=WeightHash.State.HASHING).first()
        if row is None:
            return "lost"
        beat = _Beat(revision_id, owner)
        started = time.monotonic()
        try:
            beat.renew(0, force=True)
            digest = hash_plan(Plan.from_json(row.plan), beat)
        except LeaseLost:
            logger.warning("hash of revision %s stopped: taken over by another process, or deleted", revision_id)
            return "lost"
        except (WeightsChanged, OSError) as exc:
            reason = str(exc) if isinstance(exc, WeightsChanged) else f"cannot read the weights: {exc}"
            return _fail(revision_id, owner, reason)
        return _land(revision_id, owner, digest, time.monotonic() - started)
    except Exception:
        logger.exception("hashing revision %s failed; it is resumed once its lease is stale", revision_id)
        return "error"
    finally:
        connection.close()


def _target(revision: ModelRevision) -> str:
    return f"{revision.deployment.name}@{revision.label}"


def _fail(revision_id: int, owner: str, reason: str) -> str:
    with transaction.atomic():
        if not WeightHash.objects.filter(_live(), pk=revision_id, owner=owner, state=WeightHash.State.HASHING) \
                .update(state=WeightHash.State.FAILED, error=reason[:2000], heartbeat_at=timezone.now()):
            return "lost"
        revision = ModelRevision.objects.select_related("deployment").get(pk=revision_id)
        audit_record(actor=ACTOR, action="revision.digest_failed", target=_target(revision),
                     new={"error": reason[:2000]}, result="failed")
    logger.warning("hashing the weights of %s failed: %s", _target(revision), reason)
    return "failed"


def _land(revision_id: int, owner: str, digest: str, seconds: float) -> str:
    from controlplane.runtime.warm import warm_after_commit

    with transaction.atomic():
        row = WeightHash.objects.select_for_update().filter(_live(), pk=revision_id, owner=owner,
                                                           state=WeightHash.State.HASHING).first()
        if row is None:
            return "lost"
        ModelRevision.objects.filter(pk=revision_id, digest="").update(digest=digest)
        row.delete()
        revision = ModelRevision.objects.select_related("deployment").get(pk=revision_id)
        audit_record(actor=ACTOR, action="revision.digest", target=_target(revision),
                     new={"digest": digest, "bytes": row.total_bytes, "seconds": round(seconds, 1)})
        deployment = ModelDeployment.objects.select_related("active_revision").get(pk=revision.deployment_id)
        if deployment.active_revision_id == revision_id:
            warm_after_commit(deployment)  # its replicas start now (where enabled), as at its creation
    logger.info("weights of %s hashed: %s (%.1f s)", _target(revision), digest, seconds)
    return "ready"


def _stale() -> Q:
    before = timezone.now() - timedelta(seconds=stale_seconds())
    return Q(state=WeightHash.State.HASHING) & (Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=before))


def resume_stale() -> list[int]:
    """Take over every hash whose process stopped renewing its lease, each from the start in a thread
    of this process (and drop those of deleted revisions); returns the revision ids taken."""
    WeightHash.objects.exclude(_live()).delete()  # their revision or deployment was deleted
    taken = []
    for revision_id in WeightHash.objects.filter(_stale(), _live()).values_list("pk", flat=True):
        owner = _owner()
        if WeightHash.objects.filter(_stale(), _live(), pk=revision_id).update(
                owner=owner, heartbeat_at=timezone.now(), done_bytes=0, attempts=F("attempts") + 1):
            logger.warning("resuming the weights hash of revision %s (its process stopped)", revision_id)
            _start(revision_id, owner)
            taken.append(revision_id)
    return taken


def start_at_startup() -> threading.Thread | None:
    """A web process's startup hook: ``resume_stale`` now and every half staleness window after, in a
    daemon thread for the life of the process (one indexed query a round), so a hash whose process
    died is taken over by whichever web process lives; None where ``STRATA_DIGEST_RESUME`` is off (the
    test process, whose in-process server must leave the tests' rows alone)."""
    if not getattr(settings, "STRATA_DIGEST_RESUME", True):
        return None

    def run() -> None:
        failing = False
        while True:
            try:
                resume_stale()
                failing = False
            except Exception as exc:  # the database may come up after the web process, or be away a while
                if not failing:
                    logger.warning("could not look for weight hashes to resume (%r); retrying", exc)
                failing = True
            finally:
                connection.close()
            time.sleep(max(1.0, stale_seconds() / 2))

    thread = threading.Thread(target=run, name="hash-resume", daemon=True)
    thread.start()
    return thread
