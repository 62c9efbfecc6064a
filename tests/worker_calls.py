"""A worker's whole answer in one call, for tests: the stream folded as the web tier folds ``collect``
(engines offer ``stream`` and ``collect``; nothing on the serving path needs a third form)."""

from __future__ import annotations

from workers.protocol import fold_completion


def complete(worker, req: dict) -> dict:
    """``req``'s events from ``worker.stream`` folded into one dict (text, tokens, logprobs, usage or error)."""
    return fold_completion(worker.stream(req))
