"""``STRATA_AUDIT_KEY_FILE``: the audit chain's key from a supplied file (a compose secret, a mounted
Kubernetes Secret). A supplied file is read as it is and never created, so a missing mount fails
instead of starting a new chain key that no earlier record verifies under; without the variable the
default ``$STRATA_HOME/audit.key`` is still generated on first use."""

from __future__ import annotations

import pytest

from controlplane import env
from controlplane.audit import chain
from strata_env.fields import EnvError

KEY = "a" * 64


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(chain, "_key_cache", {})


def _supply(settings, path):
    settings.STRATA_AUDIT_KEY, settings.STRATA_AUDIT_KEY_FILE, settings.STRATA_AUDIT_KEY_GENERATE = None, path, False


def test_the_variable_names_the_file_and_only_its_absence_lets_the_default_be_generated(tmp_path):
    supplied = env.load({"STRATA_HOME": str(tmp_path), "STRATA_AUDIT_KEY_FILE": "/run/secrets/strata_audit_key"})
    default = env.load({"STRATA_HOME": str(tmp_path)})
    assert supplied.audit_key_file.as_posix() == "/run/secrets/strata_audit_key"
    assert supplied.audit_key_path is not None
    assert default.audit_key_file == tmp_path / "audit.key" and default.audit_key_path is None


def test_the_key_and_the_key_file_together_are_refused(tmp_path):
    with pytest.raises(EnvError, match="only one of STRATA_AUDIT_KEY and STRATA_AUDIT_KEY_FILE"):
        env.load({"STRATA_HOME": str(tmp_path), "STRATA_AUDIT_KEY": KEY, "STRATA_AUDIT_KEY_FILE": "/k"})


def test_a_supplied_file_is_read_as_it_is(settings, tmp_path):
    path = tmp_path / "audit.key"
    path.write_text(KEY + "\n")
    path.chmod(0o400)
    _supply(settings, path)
    assert chain.audit_key() == KEY.encode()


def test_a_missing_supplied_file_is_an_error_and_is_not_created_while_the_default_one_is(settings, tmp_path):
    supplied = tmp_path / "secrets" / "audit.key"
    _supply(settings, supplied)
    with pytest.raises(chain.AuditKeyError, match="does not exist"):
        chain.audit_key()
    assert not supplied.exists()

    default = tmp_path / "home" / "audit.key"
    settings.STRATA_AUDIT_KEY_FILE, settings.STRATA_AUDIT_KEY_GENERATE = default, True
    assert len(chain.audit_key()) >= 43 and default.exists()


@pytest.mark.parametrize(("mode", "text", "error"), [
    (0o640, KEY, "group/others may access it"),
    (0o604, KEY, "group/others may access it"),
    (0o600, "short", "at least 32"),
])
def test_a_supplied_file_others_may_read_or_too_short_is_refused(settings, tmp_path, mode, text, error):
    path = tmp_path / "audit.key"
    path.write_text(text)
    path.chmod(mode)
    _supply(settings, path)
    with pytest.raises(chain.AuditKeyError, match=error):
        chain.audit_key()
    path.chmod(0o600)
    path.write_text(KEY)
    assert chain.audit_key() == KEY.encode()  # the same file, fixed, is accepted


def test_a_folder_is_not_a_key_file(settings, tmp_path):
    _supply(settings, tmp_path)
    with pytest.raises(chain.AuditKeyError, match="not a regular file"):
        chain.audit_key()
