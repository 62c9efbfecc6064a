"""What the local Ray head writes stays out of other users' reach (issue 42, item 8).

Ray makes its temp root and every session folder 0777 without the sticky bit. ``make run`` gives it
a temp root inside ``$TMPDIR/strata-<uid>`` (``workers.private_tmp``), which is 0700, checked on each
start: repaired when it is ours and open, refused when it is someone else's, a symbolic link, or
under a folder others could swap it in. The last test starts a real Ray head the way the launcher
does and, when the suite runs as root, attacks its ``sockets/`` as another user.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workers.launcher import Config, Launcher, LaunchError, free_port
from workers.private_tmp import UnsafeFolderError, private_root, root_path
from workers.supervisor import Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX modes and a Ray head")
NOBODY = 65534
AS_ROOT = os.geteuid() == 0


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def base():
    """A short shared temp folder like ``/tmp`` (1777: anyone may create, nobody may rename others'
    entries), so that other users can reach into whatever is left open below it; removed after."""
    path = Path(tempfile.mkdtemp(prefix="st", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    os.system(f"rm -rf '{path}'")  # noqa: S605 - our own mkdtemp folder; Ray's files may be read-only


def test_the_private_root_is_made_0700_and_owned_by_the_user(base):
    root = private_root(base)
    assert root == (base / f"strata-{os.getuid()}", False)
    assert mode(root.path) == 0o700 and os.stat(root.path).st_uid == os.getuid()
    assert private_root(base) == root  # found again as it is


@pytest.mark.parametrize("opened", [0o777, 0o755, 0o1777, 0o770])
def test_a_root_of_ours_open_to_others_is_tightened_to_0700(base, opened):
    path = root_path(base)
    path.mkdir()
    path.chmod(opened)
    assert private_root(base) == (path, True)
    assert mode(path) == 0o700


def test_a_root_owned_by_another_user_is_refused():
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        theirs = root_path(Path(folder), uid=os.getuid() + 1)
        theirs.mkdir(mode=0o700)  # ours, so another user's as far as uid + 1 is concerned
        with pytest.raises(UnsafeFolderError, match="belongs to user"):
            private_root(Path(folder), uid=os.getuid() + 1)


@pytest.mark.skipif(not AS_ROOT, reason="chown to another user needs root")
def test_a_root_planted_by_another_user_is_refused_and_left_alone(base):
    planted = root_path(base)
    planted.mkdir()
    planted.chmod(0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolderError, match=f"belongs to user {NOBODY}"):
        private_root(base)
    assert mode(planted) == 0o777 and os.stat(planted).st_uid == NOBODY  # not adopted, not changed


def test_a_symbolic_link_in_its_place_is_refused_not_followed(base):
    target = base / "elsewhere"
    target.mkdir()
    target.chmod(0o777)
    root_path(base).symlink_to(target)
    with pytest.raises(UnsafeFolderError, match="symbolic link"):
        private_root(base)
    assert mode(target) == 0o777


def test_a_parent_others_may_write_is_refused_unless_sticky(base):
    parent = base / "shared"
    parent.mkdir()
    parent.chmod(0o777)  # others could rename our folder away and put theirs in its place
    with pytest.raises(UnsafeFolderError, match="writable by other users without the sticky bit"):
        private_root(parent)
    assert not root_path(parent).exists()
    parent.chmod(0o1777)  # like /tmp: they cannot touch our entry
    assert mode(private_root(parent).path) == 0o700


@pytest.mark.skipif(not AS_ROOT, reason="chown to another user needs root")
def test_a_parent_owned_by_another_user_is_refused(base):
    parent = base / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolderError, match=f"belongs to user {NOBODY}"):
        private_root(parent)


def test_the_launcher_refuses_to_start_ray_in_an_unsafe_folder(base, monkeypatch):
    parent = base / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    launcher = Launcher(Config(home=base / "home", port=1, demo=False, verbose=False, ray_address=None))
    with pytest.raises(LaunchError, match="sticky bit"):
        launcher.ray_head_argv(6380)


def _as_nobody(action) -> bool:
    """Run ``action`` in a child process that is user ``nobody``; True when it raised nothing."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only syscalls, then _exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException:  # noqa: BLE001 - any failure counts as "could not"
            code = 1
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


@pytest.mark.slow
def test_the_local_ray_heads_folders_are_out_of_other_users_reach(base, monkeypatch):
    for name in ("STRATA_RAY_BIND", "RAY_AUTH_MODE", "RAY_TMPDIR", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STRATA_RAY_PORT", str(free_port()))
    monkeypatch.setattr(tempfile, "tempdir", str(base))  # the launcher's TMPDIR
    home = base / "home"
    home.mkdir(mode=0o700)
    sup = Supervisor(stop_timeout=20, log=lambda _msg: None)
    launcher = Launcher(Config(home=home, port=1, demo=False, verbose=False, ray_address=None), sup)
    try:
        launcher.start_ray()  # returns once the head listens: its session folders exist
        root = base / f"strata-{os.getuid()}"
        assert launcher.env["RAY_TMPDIR"] == str(root)  # web and Celery write inside it too
        argv = sup.children[0].launch["argv"]
        temp_dir = Path(next(a for a in argv if a.startswith("--temp-dir=")).partition("=")[2])
        sockets = next(temp_dir.glob("session_*/sockets"))
        for _ in range(1200):  # the GCS listens first; the raylet makes its socket soon after
            if (sockets / "raylet").exists() or sup.children[0].proc.poll() is not None:
                break
            time.sleep(0.1)
        entries = sorted(p.name for p in sockets.iterdir())
        assert "raylet" in entries, entries
        if AS_ROOT:  # the reported attack, as another local user
            victim = sockets / entries[0]
            assert not _as_nobody(lambda: os.rename(victim, f"{victim}.moved"))
            assert not _as_nobody(lambda: os.listdir(sockets))
            assert victim.exists()
            # The same user can write where it is let in: the refusals above are the folder's doing.
            assert _as_nobody(lambda: (base / "nobody-was-here").touch())
        # Every folder from the shared temp folder down to the head's sockets is ours, and the first
        # is 0700: however Ray widened the folders below it (it makes them 0777), no one else reaches them.
        below = sockets.relative_to(base)
        for folder in (base / part for part in (*reversed(below.parents[:-1]), below)):
            assert os.stat(folder).st_uid == os.getuid(), folder
        assert base / below.parts[0] == root and mode(root) == 0o700
    finally:
        sup.stop()
