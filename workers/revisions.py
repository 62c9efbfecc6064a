"""The revisions of a ``CacheWorker``'s deployment: the active one, those staged beside it, and the
rollout that switches between them (``stage`` / ``switch``, retiring the old revision's cache).

:class:`RevisionManager` owns that state under its own lock. Its collaborators: the worker's
``CacheEngine`` (``retire`` / ``unretire`` / ``flush`` / ``running`` / ``check_integrity``: public
methods only) and ``Scheduler`` (each revision's ``CompletionRunner`` submits to it), the deployment's
name, preset, block size and dtype, and the worker's ``WorkerConfig`` (weights root, prefill chunk).
A revision's running requests are the engine's sequences tagged with its label; a stream polls
``aborting(label)`` every step, so a switch past its drain deadline stops the old revision's stragglers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cachecore.model.hf_config import weights_root
from cachecore.model.loader import LoadedModel, RevisionSpec, load_model
from cachecore.passing_thread import on_passing_thread
from cachecore.runner import CompletionRunner
from workers.config import WorkerConfig


@dataclass(frozen=True)
class Revision:
    """One loaded revision and the runner that serves completions on it."""

    loaded: LoadedModel
    runner: CompletionRunner

    @property
    def label(self) -> str:
        return self.loaded.revision.label


def load_revision(deployment: str, preset: str, revision: dict, *, config: WorkerConfig, device: str | None,
                  block_size: int, dtype: str | None) -> LoadedModel:
    """Load ``revision`` (a ``RevisionSpec`` as a dict) of the deployment; a checkpoint's files may not
    lead outside ``config.weights_root``. The load runs on the worker's compute threads, on a thread
    of its own that ends with it (``cachecore.passing_thread``: the loop thread's thread pool stays the
    process's only one)."""

    spec = RevisionSpec.from_dict(revision)

    def load() -> LoadedModel:
        with weights_root(config.weights_root):
            return load_model(deployment, preset, spec, device=device, block_size=block_size, dtype=dtype)

    return on_passing_thread(load, threads=config.compute_threads(), name="strata-load-revision")


class RevisionManager:
    """The active revision (``active``: read it once per request), the staged ones and the rollout."""

    def __init__(self, first: LoadedModel, *, engine, scheduler, deployment: str, preset: str,
                 config: WorkerConfig, block_size: int, dtype: str | None) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.deployment, self.preset, self.config = deployment, preset, config
        self.block_size, self.dtype = block_size, dtype
        self.device = str(first.model.device)  # where the engine's pages are: staged revisions load there too
        self._lock = threading.Lock()
        self.active = self._revision(first)
        self._staged: dict[str, Revision] = {}
        self._aborting: set[str] = set()  # revisions whose running requests must stop now

    def _revision(self, loaded: LoadedModel) -> Revision:
        return Revision(loaded, CompletionRunner(
            loaded.model, self.engine, loaded.tokenizer, model_name=self.deployment,
            revision=loaded.revision.label, scheduler=self.scheduler, prefill_chunk=self.config.prefill_chunk))

    def aborting(self, label: str) -> bool:
        """Whether the running requests of revision ``label`` must stop now (a switch's deadline passed)."""
        return label in self._aborting

    def stage(self, revision: dict) -> dict:
        """Load a new revision's weights beside the active one (no effect on serving yet)."""
        loaded = load_revision(self.deployment, self.preset, revision, config=self.config, device=self.device,
                               block_size=self.block_size, dtype=self.dtype)
        label = loaded.revision.label
        with self._lock:
            self._staged[label] = self._revision(loaded)
        return {"revision": label, "weight_digest": loaded.weight_digest}

    def switch(self, label: str, *, drain_seconds: float = 10.0) -> dict:
        """Rollout: stop hits for the old revision, switch atomically, drain the old revision's running
        requests until the deadline, abort the rest (retryable error), then free the old pages."""
        with self._lock:
            if self.active.label == label:
                return {"switched": False, "revision": label, "aborted": 0, "blocks_freed": 0}
            new = self._staged.pop(label, None)
            if new is None:
                raise ValueError(f"revision {label!r} is not staged on this worker")
            old = self.active.label
            retired = self.engine.retire(self.deployment, old)  # no more hits or stores for the old namespace
            self.engine.unretire(self.deployment, label)  # a rollback to an earlier label caches again
            self.active = new  # new requests now run on the new revision
        aborted = self._drain(old, drain_seconds)
        freed = self.engine.flush(lambda t: t.revision == old)  # anything registered while draining
        self.engine.check_integrity()
        tiers = {t: retired["tiers"][t] + freed["tiers"][t] for t in ("l1", "l2", "l3")}
        l3_bytes = retired["l3_bytes"] + freed["l3_bytes"]
        return {"switched": True, "from": old, "revision": label, "aborted": aborted,
                "blocks_freed": retired["blocks_freed"] + freed["blocks_freed"], "tiers": tiers,
                "l3_bytes": l3_bytes,
                "bytes": (tiers["l1"] + tiers["l2"]) * self.engine.layout.bytes_per_block + l3_bytes}

    def _drain(self, label: str, drain_seconds: float) -> int:
        """Wait until revision ``label`` runs nothing or the deadline passed, then stop what still runs.
        Returns how many requests were stopped."""
        deadline = time.monotonic() + drain_seconds
        while time.monotonic() < deadline and self._running_of(label):
            time.sleep(0.01)
        aborted = len(self._running_of(label))
        if aborted:
            self._aborting.add(label)
            while self._running_of(label):
                time.sleep(0.01)
            self._aborting.discard(label)
        return aborted

    def _running_of(self, label: str) -> list:
        return [s for s in self.engine.running() if s.tag.revision == label]
