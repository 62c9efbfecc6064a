"""The console's revision table while a revision's weights are hashed in the background
(``controlplane.hashing``): "hashing weights (N of M bytes)" in place of the digest, then a failure
with its reason; the same for a preset's ``weights_path`` file as for a checkpoint. (The ``db``
fixture's transaction never commits, so the hash recorded here never starts: the page is read as it
is while one runs.)"""

from __future__ import annotations

import pytest


@pytest.fixture
def pending(db, actor, settings, tmp_path):
    from controlplane.registry.services import model_create

    settings.STRATA_DIGEST_INLINE_BYTES = 0
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\0" * 4096)
    return model_create(actor=actor, name="hashing-m", preset="tiny", revision={"label": "r1",
                                                                               "weights_path": str(weights)})


def test_the_page_shows_hashing_progress_then_the_failure(viewer_ui, pending):
    from controlplane.hashing.models import WeightHash

    revision = pending.active_revision
    assert revision.digest == "" and WeightHash.objects.get(pk=revision.pk).plan["kind"] == "file"
    page = viewer_ui.get("/ui/models/").content.decode()
    assert "hashing weights (0 of 4,096 bytes, 0%)" in page and "status-failed" not in page
    WeightHash.objects.filter(pk=revision.pk).update(done_bytes=1024)
    assert "hashing weights (1,024 of 4,096 bytes, 25%)" in viewer_ui.get("/ui/models/").content.decode()
    WeightHash.objects.filter(pk=revision.pk).update(state="failed", error="w.safetensors changed while it was hashed")
    page = viewer_ui.get("/ui/models/").content.decode()
    assert "status-failed" in page and "hashing weights failed: w.safetensors changed while it was hashed" in page


def test_a_weights_file_plan_hashes_to_the_file_s_sha256(tmp_path):
    from cachecore.model.digests import sha256_file
    from controlplane.hashing.hasher import WeightsChanged, hash_plan, plan_file

    weights = tmp_path / "w.bin"
    weights.write_bytes(bytes(range(256)) * 70_000)  # more than two chunks
    seen: list[int] = []
    plan = plan_file(weights)
    assert hash_plan(plan, seen.append) == sha256_file(weights)
    assert seen[-1] == plan.total_bytes and seen == sorted(seen)
    with weights.open("ab") as fh:
        fh.write(b"more")
    with pytest.raises(WeightsChanged):
        hash_plan(plan)
