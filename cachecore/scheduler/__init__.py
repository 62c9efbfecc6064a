"""Continuous batching on a worker: ``Scheduler`` (the loop), ``Request`` (a request's state)."""

from cachecore.scheduler.events import Event, Finished, Prefilled, TokenOut
from cachecore.scheduler.loop import Scheduler
from cachecore.scheduler.request import Failed, Logits, Request, State

__all__ = ["Event", "Failed", "Finished", "Logits", "Prefilled", "Request", "Scheduler", "State", "TokenOut"]
