"""Registry writes: model deployments, revisions, switching the active revision. Every write is audited
in the same transaction.

Digests come from cachecore's torch-free ``cachecore.model.digests``: seeded revisions use
``seeded_digest(preset(name), model_name=, revision_label=, seed=)``; file
revisions use the SHA-256 of the file's bytes, the same digest ``load_safetensors`` reports;
checkpoint revisions (a Hugging Face directory, ``path``) are validated by
``cachecore.model.checkpoint.inspect_checkpoint`` (config, tensor shapes, tokenizer, chat template) and
record its weight digest. Weights are validated on the request, but hashed there only when small
(``hashing.services.digest_now_or_later``, before the transaction opens so no lock is held while a file
is hashed); bigger ones are recorded with digest ``""`` (pending) and hashed in the background
(``hashing.services.hash_later``), the revision held until its digest lands (``hashing.selectors.hold``).
A checkpoint deployment has no preset (``preset == ""``); its architecture is the
checkpoint's, and every revision must keep the KV layout of the deployment's first one.

A deployment's ``engine`` (``strata`` | ``vllm``) and ``tensor_parallel_size`` are chosen at creation
by the rules of ``registry.engines`` and fixed after; a ``vllm`` deployment's checkpoints are inspected
generically (``inspect_checkpoint(..., engine="vllm")``: any architecture vLLM serves).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from cachecore.model.digests import seeded_digest
from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.hashing import services as hashing
from controlplane.hashing.hasher import Plan, WeightsChanged, plan_checkpoint, plan_file
from controlplane.registry import engines
from controlplane.registry.models import ModelDeployment, ModelRevision, label_validator, name_validator

ARCHITECTURES = ("llama",)
MAX_SEED = 2**63 - 1


def _validate(validator, value: str, what: str) -> None:
    try:
        validator(value)
    except ValidationError as exc:
        raise InvalidInput(f"{what}: {'; '.join(exc.messages)}") from None


def _preset_config(preset: str):
    from cachecore.model.config import preset as preset_config

    try:
        return preset_config(preset)
    except ValueError as exc:
        raise InvalidInput(str(exc), code="unknown_preset") from None


def _weights_file(weights_path: str) -> Path:
    path = Path(weights_path).expanduser().resolve()
    root = settings.STRATA_WEIGHTS_ROOT
    if root is not None and not path.is_relative_to(root):
        raise InvalidInput(f"weights_path must be inside {root}", code="invalid_weights_path")
    if not path.is_file():
        raise InvalidInput(f"weights_path {weights_path!r} is not a readable file", code="invalid_weights_path")
    return path


def _checkpoint(path: Any, engine: str = engines.STRATA, *, digest: bool = True):
    """``inspect_checkpoint`` of ``path`` for ``engine`` (inside ``STRATA_WEIGHTS_ROOT`` when set,
    every file in it too, symlinks followed); 422 with the reason (``invalid_checkpoint``) for a missing
    directory, an unsupported architecture, bad files, a file resolving outside the root."""
    from cachecore.model.checkpoint import inspect_checkpoint
    from cachecore.model.hf_config import CheckpointError, weights_root

    resolved = Path(str(path)).expanduser().resolve()
    root = settings.STRATA_WEIGHTS_ROOT
    if root is not None and not resolved.is_relative_to(root):
        raise InvalidInput(f"path must be inside {root}", code="invalid_checkpoint")
    try:
        with weights_root(root):
            return inspect_checkpoint(resolved, digest=digest, engine=engine)
    except CheckpointError as exc:
        raise InvalidInput(str(exc), code="invalid_checkpoint") from None


def _digest(make_plan: Callable[[], Plan], code: str) -> tuple[str, Plan | None]:
    """``(digest, None)`` with the weights hashed now, or ``("", plan)`` when they are hashed in the
    background (see the module docstring); 422 ``code`` for files that cannot be read or that change
    under the hashing."""
    from cachecore.model.hf_config import CheckpointError

    try:
        plan = make_plan()
        digest = hashing.digest_now_or_later(plan)
    except (CheckpointError, WeightsChanged, OSError) as exc:
        raise InvalidInput(f"cannot hash the weights: {exc}", code=code) from None
    return digest, None if digest else plan


def _checkpoint_for(path: Any, engine: str):
    """A new revision's checkpoint for a deployment served by ``engine``: inspected for it; for
    ``vllm`` also vLLM installed and able to serve it (``engines.vllm_refusal``), else 422."""
    if engine == engines.VLLM:
        missing = engines.vllm_missing()
        if missing:
            raise InvalidInput(f"this model is served by engine 'vllm': {missing}", code="invalid_engine")
        info = _checkpoint(path, engine)
        refusal = engines.vllm_refusal(info.config)
        if refusal:
            raise InvalidInput(f"engine 'vllm' cannot serve this checkpoint here: {refusal}", code="invalid_engine")
        return info
    return _checkpoint(path, engine)


def _revision_source(
    *, model_name: str, preset: str, label: str, seed: Any, weights_path: Any, path: Any = None,
    engine: str = engines.STRATA,
) -> tuple[int | None, str | None, str | None, str, Plan | None]:
    """Validate the weights source; return ``(seed, resolved weights_path, checkpoint directory, digest,
    plan)``: ``plan`` is what to hash in the background when ``digest`` is ``""`` (pending)."""
    _validate(label_validator, label, "label")
    if sum(x is not None for x in (seed, weights_path, path)) != 1:
        raise InvalidInput("give exactly one of 'seed', 'weights_path' or 'path'", code="invalid_revision_source")
    if path is not None:
        if preset:
            raise InvalidInput(f"this model runs preset {preset!r}; a checkpoint 'path' needs a model created "
                               "from a checkpoint", code="invalid_revision_source")
        info = _checkpoint_for(path, engine)
        digest, plan = _digest(lambda: plan_checkpoint(Path(info.path)), "invalid_checkpoint")
        return None, None, info.path, digest, plan
    if not preset:
        raise InvalidInput("this model serves a checkpoint directory: give the revision a 'path'",
                           code="invalid_revision_source")
    config = _preset_config(preset)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InvalidInput(f"seed must be an integer in [0, {MAX_SEED}]")
        return seed, None, None, seeded_digest(config, model_name=model_name, revision_label=label, seed=seed), None
    file = _weights_file(str(weights_path))
    digest, plan = _digest(lambda: plan_file(file), "invalid_weights_path")
    return None, str(file), None, digest, plan


def _revision_view(revision: ModelRevision) -> dict[str, Any]:
    view = {"label": revision.label, "source": revision.source, "digest": revision.digest}
    if revision.seed is not None:
        view["seed"] = revision.seed
    elif revision.checkpoint_path:
        view["path"] = revision.checkpoint_path
    else:
        view["weights_path"] = revision.weights_path
    return view


def model_create(
    *,
    actor: Actor,
    name: str,
    preset: str,
    revision: Mapping[str, Any],
    architecture: str = "llama",
    tokenizer: str = "byte",
    engine: str | None = None,
    tensor_parallel_size: int = 1,
) -> ModelDeployment:
    """Create a deployment with its first revision, which becomes active.

    A revision with a checkpoint ``path`` takes no preset: the architecture comes from its
    ``config.json`` and the tokenizer is the checkpoint's (``"hf"``). ``engine`` (None: the default)
    and ``tensor_parallel_size`` follow the rules of ``registry.engines``; both are audited.

    Raises InvalidInput (bad name/label, unknown preset or architecture, not exactly one weights
    source, unreadable file, unusable checkpoint, an engine or tensor parallel size that cannot serve
    it), Unavailable (``tensor_parallel_size`` > 1 and Ray unreachable) or Conflict (name taken).
    """
    _validate(name_validator, name, "name")
    label = str(revision.get("label") or "")
    if revision.get("path") is not None:
        if preset:
            raise InvalidInput("a checkpoint 'path' brings its own architecture: give no preset",
                               code="invalid_revision_source")
        _validate(label_validator, label, "label")
        if revision.get("seed") is not None or revision.get("weights_path") is not None:
            raise InvalidInput("give exactly one of 'seed', 'weights_path' or 'path'", code="invalid_revision_source")
        engine, info = engines.checkpoint_engine(
            engine, lambda which: _checkpoint(revision["path"], which, digest=False))
        tensor_parallel_size = engines.check_tensor_parallel(engine, tensor_parallel_size)
        digest, later = _digest(lambda: plan_checkpoint(Path(info.path)), "invalid_checkpoint")
        architecture, tokenizer = info.config.model_type[:32], "hf"
        seed, weights_path, checkpoint_path = None, None, info.path
    else:
        if not preset:
            raise InvalidInput("give a preset (or a checkpoint 'path' for the revision)", code="unknown_preset")
        if architecture not in ARCHITECTURES:
            raise InvalidInput(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
        engine = engines.preset_engine(engine)
        tensor_parallel_size = engines.check_tensor_parallel(engine, tensor_parallel_size)
        seed, weights_path, checkpoint_path, digest, later = _revision_source(
            model_name=name, preset=preset, label=label, seed=revision.get("seed"),
            weights_path=revision.get("weights_path"),
        )
    with transaction.atomic():
        taken = ModelDeployment.all_objects.filter(name=name, purged_at__isnull=True).first()
        if taken is not None and taken.deleted_at is not None:
            raise Conflict(f"model {name!r} is being deleted; its name is free once its delete job succeeds",
                           code="model_deleting")
        if taken is not None:
            raise Conflict(f"model {name!r} already exists")
        deployment = ModelDeployment.objects.create(
            name=name, preset=preset, architecture=architecture, tokenizer=tokenizer, engine=engine,
            tensor_parallel_size=tensor_parallel_size,
        )
        first = ModelRevision.objects.create(
            deployment=deployment, label=label, seed=seed, weights_path=weights_path,
            checkpoint_path=checkpoint_path, digest=digest,
        )
        if later is not None:
            hashing.hash_later(revision=first, plan=later)
        deployment.active_revision = first
        deployment.save(update_fields=["active_revision"])
        audit_record(
            actor=actor, action="model.create", target=name,
            new={"name": name, "preset": preset, "architecture": architecture, "tokenizer": tokenizer,
                 "engine": engine, "tensor_parallel_size": tensor_parallel_size, "revision": _revision_view(first)},
        )
        from controlplane.runtime.warm import warm_after_commit

        warm_after_commit(deployment)  # its replicas start now (where enabled), not at its first request
    return deployment


def revision_create(
    *, actor: Actor, deployment: ModelDeployment, label: str, seed: int | None = None,
    weights_path: str | None = None, path: str | None = None,
) -> ModelRevision:
    """Add a revision (not active: switching is the rollout job's ``model_activate_revision``).

    A checkpoint revision is inspected for the deployment's engine and must keep the deployment's
    architecture and KV layout (layers, KV heads, head size, dtype): its workers' pages are built for
    it. Raises
    InvalidInput (see ``model_create``) or Conflict (label taken for this deployment).
    """
    seed, weights_path, checkpoint_path, digest, later = _revision_source(
        model_name=deployment.name, preset=deployment.preset, label=label, seed=seed, weights_path=weights_path,
        path=path, engine=deployment.engine,
    )
    if checkpoint_path is not None:
        _check_same_layout(deployment, checkpoint_path)
    with transaction.atomic():
        taken = ModelRevision.all_objects.filter(deployment=deployment, label=label).first()  # deleted ones too
        if taken is not None and taken.deleted_at is not None:
            raise Conflict(f"model {deployment.name!r} had a revision {label!r}, deleted: a label is not reused")
        if taken is not None:
            raise Conflict(f"model {deployment.name!r} already has a revision {label!r}")
        revision = ModelRevision.objects.create(
            deployment=deployment, label=label, seed=seed, weights_path=weights_path,
            checkpoint_path=checkpoint_path, digest=digest,
        )
        if later is not None:
            hashing.hash_later(revision=revision, plan=later)
        audit_record(
            actor=actor, action="revision.create", target=f"{deployment.name}@{label}",
            new=_revision_view(revision),
        )
    return revision


def _check_same_layout(deployment: ModelDeployment, checkpoint_path: str) -> None:
    from cachecore.model.checkpoint import inspect_checkpoint
    from cachecore.model.hf_config import CheckpointError

    first = deployment.revisions.exclude(checkpoint_path=None).order_by("pk").first()
    if first is None:
        return
    new = inspect_checkpoint(checkpoint_path, digest=False, engine=deployment.engine)
    try:
        old = inspect_checkpoint(first.checkpoint_path, digest=False, engine=deployment.engine)
    except CheckpointError:
        return  # the old directory is gone: nothing to compare with (its workers hold their pages)
    if new.config.architecture != old.config.architecture:
        raise InvalidInput(
            f"checkpoint's architecture {new.config.architecture} differs from model {deployment.name!r}'s "
            f"{old.config.architecture}; serve it as a new model", code="invalid_checkpoint")
    if new.layout_key() != old.layout_key():
        raise InvalidInput(
            f"checkpoint's KV layout (layers, KV heads, head size, dtype) {new.layout_key()} differs from "
            f"model {deployment.name!r}'s {old.layout_key()}; serve it as a new model", code="invalid_checkpoint")


def model_activate_revision(
    *, actor: Actor, deployment: ModelDeployment, revision: ModelRevision, reason: str = ""
) -> ModelDeployment:
    """Atomically make ``revision`` the active one (the rollout job calls this after draining).

    Row-locks the deployment so concurrent switches serialise. Raises InvalidInput if the revision
    belongs to another deployment. Activating the already-active revision is a no-op (no event).
    """
    if revision.deployment_id != deployment.pk:
        raise InvalidInput(f"revision {revision.label!r} does not belong to model {deployment.name!r}")
    with transaction.atomic():
        locked = ModelDeployment.objects.select_for_update(of=("self",)).get(pk=deployment.pk)
        old = locked.active_revision  # read after the lock: the current value, not a stale one
        if old is not None and old.pk == revision.pk:
            return locked
        locked.active_revision = revision
        locked.save(update_fields=["active_revision"])
        audit_record(
            actor=actor, action="model.activate", target=deployment.name, reason=reason,
            old={"revision": old.label if old else None}, new={"revision": revision.label},
        )
    deployment.active_revision = revision
    return locked


MAX_REPLICAS = 16  # replicas per deployment (the admin API's bound, and the gateway's ReplicaSet's)


def model_set_replicas(
    *, actor: Actor, deployment: ModelDeployment, replicas: int, reason: str = ""
) -> ModelDeployment:
    """Set how many replicas serve ``deployment`` (0..``MAX_REPLICAS``), audited (``model.scale``).
    Every process routes by the new count from its next request on; once committed, this process also
    brings the cluster to it (``gateway.apply_scale``, in the background): new replicas are started,
    replicas beyond the count drained (no new requests, running ones finish or hit the drain deadline)
    and stopped. 0 stops the deployment (tenants get 503 ``model_stopped``; its cached KV in L3 stays);
    a positive count starts it again. Setting the current count changes nothing (no event). Raises
    InvalidInput."""
    from controlplane.runtime import gateway

    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_REPLICAS:
        raise InvalidInput(f"replicas must be an integer from 0 (stopped) to {MAX_REPLICAS}",
                           code="invalid_replicas")
    with transaction.atomic():
        locked = ModelDeployment.objects.select_for_update(of=("self",)).select_related("active_revision").get(
            pk=deployment.pk)
        old = locked.replicas
        if old == replicas:
            return locked
        locked.replicas = replicas
        locked.save(update_fields=["replicas"])
        audit_record(actor=actor, action="model.scale", target=deployment.name, reason=reason,
                     old={"replicas": old}, new={"replicas": replicas})
        if locked.active_revision is not None:
            spec = gateway.spec_for(locked)
            transaction.on_commit(lambda: gateway.apply_scale(spec))
    deployment.replicas = replicas
    return locked


def model_check_engine(*, deployment: ModelDeployment, engine: str) -> ModelDeployment:
    """A change of ``deployment``'s engine: none is possible (the engine is chosen when the deployment
    is created, and its replicas, revisions and cache are built for it), so naming another engine is a
    Conflict (409 ``engine_fixed``); naming the current one changes nothing (no event)."""
    engines.check_engine_name(engine)
    if engine != deployment.engine:
        raise Conflict(f"model {deployment.name!r} is served by engine {deployment.engine!r}; the engine is "
                       "chosen when the deployment is created: create a new deployment", code="engine_fixed")
    return deployment

