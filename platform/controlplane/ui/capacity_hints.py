"""The model page's KV capacity hints: each replica's ``runtime.capacity`` figures, display-ready
(tokens, bytes and sequences of the model's full context per tier, and how old the sample is)."""

from __future__ import annotations

from typing import Any

from controlplane.ui.present import human_bytes

STATES = {"ok": "running", "starting": "starting", "unreachable": "did not answer", "not started": "not started",
          "pending": "no sample yet"}


def capacity_rows(replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per replica: ``replica``, ``state``, ``age`` (a note when the sample is stale),
    ``tiers`` (``label``, ``tokens``, ``bytes``, ``sequences``) and ``tokens`` / ``sequences`` (L1+L2),
    ``context`` (the model's context length) and ``has_figures``."""
    rows = []
    for rep in replicas:
        tiers = [{"name": name, "label": t["label"], "tokens": t["tokens"], "bytes": human_bytes(t["bytes"]),
                  "sequences": t["sequences"]} for name, t in (rep.get("tiers") or {}).items()]
        age = rep.get("age_s")
        rows.append({"replica": rep["replica"], "state": STATES.get(rep.get("status") or "", rep.get("status")),
                     "age": f"sample {age:.0f} s old" if rep.get("stale") and age is not None else "",
                     "tiers": tiers, "tokens": rep.get("tokens"), "sequences": rep.get("sequences"),
                     "context": rep.get("context_tokens"), "block_size": rep.get("block_size"),
                     "has_figures": bool(tiers)})
    return rows
