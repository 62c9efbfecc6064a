"""Checkpoint files opened through symlinks that point outside ``STRATA_WEIGHTS_ROOT`` are refused:
config.json, safetensors shards, tokenizer files, the template and the generation config, at the admin
API (422), in the web process's model facts and in the worker, while a symlink that stays inside the
root is followed."""

from __future__ import annotations

import shutil

import pytest

from cachecore.model.checkpoint import inspect_checkpoint
from cachecore.model.hf_config import CheckpointError, weights_root
from tests.controlplane.helpers import assert_error, post
from tests.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("confine-src") / "ckpt"
    build_checkpoint("qwen2", path, seed=7, layers=1)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return path


def _layout(tmp_path, source, outside: str | None):
    """``root/ckpt``: a copy of the checkpoint whose file ``outside`` is a symlink to an identical file
    outside ``root`` (so only the confinement can refuse it)."""
    root, away = tmp_path / "weights", tmp_path / "elsewhere"
    shutil.copytree(source, root / "ckpt")
    away.mkdir()
    if outside is not None:
        shutil.move(root / "ckpt" / outside, away / outside)
        (root / "ckpt" / outside).symlink_to(away / outside)
    return root, root / "ckpt"


@pytest.mark.parametrize("name", [*FILES, "chat_template.jinja"])
def test_a_checkpoint_file_symlinked_outside_the_root_is_refused(tmp_path, source, name):
    root, ckpt = _layout(tmp_path, source, name)
    assert inspect_checkpoint(ckpt, digest=False).config  # unconfined, the link is followed
    with weights_root(root), pytest.raises(CheckpointError, match=f"{name!r} resolves outside the weights root"):
        inspect_checkpoint(ckpt)


def test_symlinks_that_stay_inside_the_root_are_followed(tmp_path, source):
    root, ckpt = _layout(tmp_path, source, None)
    blobs = root / "blobs"
    blobs.mkdir()
    shutil.move(ckpt / "model.safetensors", blobs / "weights")  # the Hugging Face cache's layout
    (ckpt / "model.safetensors").symlink_to(blobs / "weights")
    with weights_root(root):
        assert inspect_checkpoint(ckpt).digest


def test_a_checkpoint_directory_symlinked_out_of_the_root_is_refused(tmp_path, source):
    root, ckpt = _layout(tmp_path, source, None)
    (root / "link").symlink_to(tmp_path / "elsewhere")
    shutil.copytree(ckpt, tmp_path / "elsewhere" / "ckpt")
    with weights_root(root), pytest.raises(CheckpointError, match="outside the weights root"):
        inspect_checkpoint(root / "link" / "ckpt")


@pytest.mark.django_db
def test_the_admin_api_answers_422_for_a_symlink_out_of_the_root(admin_client, settings, tmp_path, source):
    root, ckpt = _layout(tmp_path, source, "tokenizer.json")
    settings.STRATA_WEIGHTS_ROOT = root
    body = {"name": "linked", "revision": {"label": "r1", "path": str(ckpt)}}
    err = assert_error(post(admin_client, "/api/admin/models", body), 422, "invalid_checkpoint")
    assert "tokenizer.json" in err["message"] and "elsewhere" not in err["message"]  # names the file, not its target


def test_the_worker_refuses_to_load_a_checkpoint_with_a_file_outside_its_root(tmp_path, source):
    from workers.cache_worker import CacheWorker
    from workers.config import WorkerConfig

    root, ckpt = _layout(tmp_path, source, "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        CacheWorker(deployment="linked", preset="", device="cpu", l1_mb=4, config=WorkerConfig(weights_root=str(root)),
                    revision={"label": "r1", "checkpoint_path": str(ckpt)})


@pytest.mark.django_db
def test_the_web_process_refuses_a_file_swapped_for_a_symlink_out_of_the_root(admin_client, settings, tmp_path,
                                                                               source):
    from controlplane.common.errors import Unavailable
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving.model_facts import model_facts

    root, ckpt = _layout(tmp_path, source, None)
    settings.STRATA_WEIGHTS_ROOT = root
    body = {"name": "swapped", "revision": {"label": "r1", "path": str(ckpt)}}
    assert post(admin_client, "/api/admin/models", body).status_code == 201
    shutil.move(ckpt / "tokenizer_config.json", tmp_path / "elsewhere" / "tokenizer_config.json")
    (ckpt / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere" / "tokenizer_config.json")
    deployment = ModelDeployment.objects.select_related("active_revision").get(name="swapped")
    with pytest.raises(Unavailable, match="tokenizer_config.json"):
        model_facts(deployment)
