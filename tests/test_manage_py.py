"""``manage.py`` on a state folder with no database: one clear line and exit 2, not a traceback, and
no stray folder left behind (the README's operator-token recipe with a custom ``STRATA_HOME``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_database_is_one_line_and_leaves_nothing(tmp_path):
    home = tmp_path / "not-made-yet"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env["STRATA_HOME"] = str(home)
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "create_operator_token", "--username", "ops",
                          "--role", "admin"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""  # so $(... | tail -1) is empty, and the shell says why on stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(home) in lines[0] and "STRATA_HOME" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not home.exists()
