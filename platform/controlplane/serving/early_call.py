"""A whole (non-streamed) completion's worker call, started on its preparation thread.

The view's preparation job (``context.prepare``) ends on a serving database thread; the worker call
used to start only once the event loop had taken the prepared request back and found time for it.
``EarlyCall.start``, the job's last step, submits it there (``gateway.submit``: the router's choice,
the replica's in-flight count, the actor call), so the worker runs while the answer travels back to
the loop, which then only awaits it (``take``, handed to ``gateway.acall``). Streamed requests keep
the loop's own call (their generator is iterated there).

A view cancelled while its job still runs (the client went away) cannot stop the thread: ``abandon``
marks the call unwanted, and whichever of the two sides comes second cancels a started call on its
worker and releases its count, so nothing runs for a request nobody waits for.
"""

from __future__ import annotations

import threading

from controlplane.runtime import gateway


class EarlyCall:
    """One request's early worker call: ``start`` (the preparation thread), then ``take`` or ``abandon``
    (the view, on the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: gateway.Started | None = None
        self._abandoned = False

    def start(self, prep) -> None:
        """Submit ``prep``'s ``collect`` unless it streams (``gateway.submit``: only the replica's choice
        when its handle is not known yet; nothing when no replica is routable, and the loop's ``acall``
        then answers the error)."""
        if prep.body.stream:
            return
        started = gateway.submit(prep.spec, "collect", prep.worker_req)
        if started is None:
            return
        with self._lock:
            if not self._abandoned:
                self._started = started
                return
        gateway.abandon(started)

    def take(self) -> gateway.Started | None:
        """The started call, handed to the caller (who now owns its await), or None."""
        with self._lock:
            started, self._started = self._started, None
        return started

    def abandon(self) -> None:
        """Nobody will await the call: cancel it if it started, and any that starts after this."""
        with self._lock:
            self._abandoned = True
            started, self._started = self._started, None
        if started is not None:
            gateway.abandon(started)
