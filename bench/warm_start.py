"""First request after a restart, cold against warm (issue 44, item 3): a vLLM deployment of a small
random checkpoint on a throwaway platform; its replica is stopped (a restart), then

- cold (the baseline, what every restart did before warm starts): warm starts off, the first
  completion starts the engine and waits for it (the bound on that wait raised so it can);
- warm: the web process's startup hook (``runtime.warm.start_at_startup``) starts the replica; once
  ``replica_states`` says ready, the first completion is timed.

    .venv/bin/python -m bench.warm_start [--quick]

Prints a table and ``RESULT cold_first_s=... warm_start_s=... warm_first_s=... speedup=...``.
``--quick`` is the same run (one engine start each way is the whole measurement).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench._platform import throwaway_platform


def _first(p) -> float:
    body = {"model": p.model, "prompt": "Hello there, how are you today?", "max_tokens": 8, "temperature": 0}
    t0 = time.perf_counter()
    answer = httpx.post(f"{p.url}/v1/completions", headers=p.headers(0), json=body, timeout=900)
    elapsed = time.perf_counter() - t0
    assert answer.status_code == 200, answer.text
    return elapsed


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__).add_argument("--quick", action="store_true")
    from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

    ckpt = Path(tempfile.mkdtemp(prefix="warm-start-ckpt-"))
    build_checkpoint("llama", ckpt, seed=11, max_pos=2048, **VLLM_CPU_SHAPE)
    with throwaway_platform(preset=None, tenants=1, quiet=True) as p:
        from django.conf import settings

        from controlplane.runtime import gateway, warm
        from controlplane.runtime.replica_states import replica_states

        dep = p.add_model("warm-bench", revision={"label": "r1", "path": str(ckpt)}, engine="vllm")
        p.stop_model(dep)  # a restart: no replica runs, this process knows none

        os.environ["STRATA_WARM_REPLICAS"] = "0"
        settings.STRATA_START_WAIT_SECONDS = 900.0  # the first request waits for its engine, as before
        cold = _first(p)
        p.stop_model(dep)
        gateway.forget(dep.name)

        settings.STRATA_START_WAIT_SECONDS = 30.0
        os.environ["STRATA_WARM_REPLICAS"] = "1"
        t0 = time.perf_counter()
        warm.start_at_startup()
        while (replica_states(dep.name, 1) or [{}])[0].get("state") != "ready":
            time.sleep(0.2)
        ready = time.perf_counter() - t0
        gateway.forget(dep.name)  # as a restarted web process: the actor runs, no handle is known
        warm_first = _first(p)
        p.stop_model(dep)

    print(f"{'case':<44} {'seconds':>9}")
    print(f"{'cold: first request after restart (baseline)':<44} {cold:>9.2f}")
    print(f"{'warm: startup hook until replica ready':<44} {ready:>9.2f}")
    print(f"{'warm: first request after restart':<44} {warm_first:>9.2f}")
    print(f"RESULT cold_first_s={cold:.2f} warm_start_s={ready:.2f} warm_first_s={warm_first:.2f} "
          f"speedup={cold / warm_first:.1f}")


if __name__ == "__main__":
    main()
