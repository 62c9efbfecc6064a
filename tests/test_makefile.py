"""``make clean`` cleans the build and never the state; ``make clean-state`` deletes the state folder
(database, master key: every L3 object unreadable) only after its name is typed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for d in (".venv", ".pytest_cache", ".strata", "custom-home"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "file").write_text("x")
    return tmp_path


def _make(tree, *args, env_home=None, stdin=""):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tree)}
    if env_home:
        env["STRATA_HOME"] = env_home
    return subprocess.run(["make", "-s", *args], cwd=tree, env=env, input=stdin, capture_output=True, text=True,
                          timeout=60)


def test_clean_keeps_the_state_folder(tree):
    assert _make(tree, "clean").returncode == 0
    assert not (tree / ".venv").exists() and not (tree / ".pytest_cache").exists()
    assert (tree / ".strata" / "file").exists()


def test_clean_state_asks_for_the_folder_name(tree):
    refused = _make(tree, "clean-state", stdin="yes\n")
    assert refused.returncode != 0 and "not deleted" in refused.stdout
    assert "master key" in refused.stdout and (tree / ".strata" / "file").exists()
    assert _make(tree, "clean-state", "CONFIRM=wrong").returncode != 0 and (tree / ".strata").exists()
    done = _make(tree, "clean-state", "CONFIRM=.strata")
    assert done.returncode == 0 and not (tree / ".strata").exists()
    # a custom STRATA_HOME is the folder it deletes, and only that one
    home = str(tree / "custom-home")
    assert _make(tree, "clean-state", f"CONFIRM={home}", env_home=home).returncode == 0
    assert not (tree / "custom-home").exists() and (tree / ".venv").exists()
