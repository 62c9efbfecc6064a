#!/usr/bin/env python
"""Django's command-line utility for the Strata control plane.

``platform/`` is a source root (never a package: it would shadow the stdlib ``platform`` module), so
it is put on ``sys.path`` here before ``controlplane`` is imported.
"""

import os
import sys
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent / "platform"


def main() -> None:
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(1, str(SOURCE_ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
