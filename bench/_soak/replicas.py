"""A Ray driver's view of the stack's replica actors: their process ids (to SIGKILL one), and the
operator-side calls the checks need (``ping``, ``drain_writes``, ``check_integrity``, ``stats``).

The driver joins the stack's own Ray head with its token (``$STRATA_HOME/ray_auth_token``) on
127.0.0.1, in the ``strata`` namespace where the launcher's web tier names its actors
(``workers.actor.actor_name``). Every call has a timeout: a dead actor is an error, never a hang.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Replicas:
    def __init__(self, *, ray_port: int, home: Path) -> None:
        # Before Ray is imported: it reads its single-machine switch (keep 127.0.0.1) at import time.
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(home / "ray_auth_token"),
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
        import ray

        ray.init(address=f"127.0.0.1:{ray_port}", namespace="strata", log_to_driver=False,
                 configure_logging=False, include_dashboard=False, _node_ip_address="127.0.0.1")
        self._ray = ray

    def close(self) -> None:
        self._ray.shutdown()

    def handle(self, model: str, replica: int):
        from workers.actor import find

        return find(model, replica)

    def call(self, model: str, replica: int, method: str, *args, timeout: float = 60.0) -> Any:
        handle = self.handle(model, replica)
        if handle is None:
            raise LookupError(f"no actor for {model}:{replica}")
        return self._ray.get(getattr(handle, method).remote(*args), timeout=timeout)

    def pid(self, model: str, replica: int, timeout: float = 30.0) -> int | None:
        handle = self.handle(model, replica)
        if handle is None:
            return None
        return int(self._ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout))
