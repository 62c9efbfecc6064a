"""Bounded rendering of untrusted Jinja chat templates: a step count, a deadline and a size cap.

Python threads cannot be killed, so a render that runs away must stop itself. ``GuardedEnvironment``
is transformers' ``ImmutableSandboxedEnvironment`` with a meter that every unit of template work
passes through:

- every ``{% for %}`` iterates through the ``strata_iter`` filter (inserted into the parsed template,
  so a template cannot avoid or redefine it), which ticks once per item;
- every call (functions, macros, methods), attribute and item lookup ticks; string and list
  arguments above the size cap and integer arguments above it (``center(10**9)``; or above the
  sandbox's range limit when that is larger) are refused before the call; ``join``/``replace`` are
  estimated and ``format`` widths checked before they allocate;
- ``*``, ``**``, ``+`` and ``%`` are intercepted and their result size checked before it is computed;
  ``~`` concatenations and every filter's result are size-checked;
- output is produced with ``generate()`` and its running length checked per chunk.

The meter raises ``RenderLimitExceeded`` after ``max_steps`` ticks, once its deadline passed (read
every 256 ticks), or when a string/list/output would pass ``max_chars``. The budget of the render in
progress lives in a context variable, so one compiled template serves many threads at once.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from cachecore.errors import InvalidPrompt

ITER_FILTER = "strata_iter"
SIZE_FILTER = "strata_size"
_DEADLINE_EVERY = 256  # ticks between two reads of the clock
_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


class RenderLimitExceeded(InvalidPrompt):
    """A chat template render passed its budget: ``limit`` names which (``steps``, ``seconds``,
    ``chars``). Raised by the template itself, so the thread that ran it is free again at once."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.code = "template_output_too_large" if limit == "chars" else "template_budget_exceeded"


@dataclass(frozen=True)
class RenderBudget:
    """What one render may cost: characters of any string, list or the output; ticks of template
    work (loop items, calls, lookups); wall-clock seconds."""

    max_chars: int = 1 << 22
    max_steps: int = 1_000_000
    seconds: float = 2.0


class Meter:
    """The running count of one render against its ``RenderBudget``."""

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.steps = 0

    def tick(self, n: int = 1) -> None:
        before, self.steps = self.steps, self.steps + n
        if self.steps > self.budget.max_steps:
            raise RenderLimitExceeded(f"the chat template exceeded its budget of {self.budget.max_steps} steps "
                                      "(loop iterations, calls and lookups)", "steps")
        if before // _DEADLINE_EVERY != self.steps // _DEADLINE_EVERY:
            self.check_deadline()

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded(f"the chat template exceeded its time budget of {self.budget.seconds:g} s",
                                      "seconds")

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.budget.max_chars:
            raise RenderLimitExceeded(f"the chat template produced {what} over the limit of "
                                      f"{self.budget.max_chars} characters", "chars")

    def sized(self, value: Any, what: str = "a value") -> Any:
        if isinstance(value, str | bytes | list | tuple | dict):
            self.size(len(value), what)
        return value


_meter: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("strata_template_meter", default=None)


def _current() -> Meter:
    """The meter of the render in progress. Outside ``render_bounded`` (a plain ``Template.render``)
    there is none to count against: each check gets a fresh default one, so sizes are still capped."""
    meter = _meter.get()
    return meter if meter is not None else Meter(RenderBudget())


def render_bounded(template, context: dict, budget: RenderBudget) -> str:
    """Render ``template`` (from a ``GuardedEnvironment``) with ``context`` under ``budget``."""
    meter = Meter(budget)
    token = _meter.set(meter)
    try:
        out, total = [], 0
        for chunk in template.generate(**context):
            total += len(chunk)
            meter.size(total, "output")
            meter.tick()
            out.append(chunk)
        return "".join(out)
    finally:
        _meter.reset(token)


def _iter_guard(value: Iterable) -> Iterator:
    meter = _current()
    for item in value:
        meter.tick()
        yield item


def _size_guard(value: Any) -> Any:
    return _current().sized(value, "a string")


class _InsertGuards(NodeTransformer):
    """Route every loop's iterable and every ``~`` result through the meter's filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, ITER_FILTER, [], [], None, None, lineno=node.iter.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Filter(node, SIZE_FILTER, [], [], None, None, lineno=node.lineno)


def _sized_len(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


def _check_args(meter: Meter, args: tuple, kwargs: dict) -> None:
    # A number argument can ask for that many characters (center, ljust, zfill, indent...): refuse one
    # above the size cap, or above the sandbox's own range limit when that is larger (range(1000) is
    # fine under a small cap; what it allocates is checked as a result).
    most = max(meter.budget.max_chars, MAX_RANGE)
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > most:
            raise RenderLimitExceeded(f"the chat template passed the number {arg} to a call, above the limit of "
                                      f"{most}", "chars")
        meter.sized(arg, "an argument")


def _estimate_call(meter: Meter, obj: Any, args: tuple) -> None:
    """Refuse the str methods whose result can be far larger than their inputs before they run."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "join" and args and isinstance(args[0], list | tuple):
        items = args[0]
        meter.size(sum(_sized_len(i) for i in items) + len(owner) * max(0, len(items) - 1), "a joined string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = owner.count(args[0]) if args[0] else len(owner) + 1
        meter.size(len(owner) + hits * max(0, len(args[1]) - len(args[0])), "a replaced string")


def _check_numbers(meter: Meter, fmt: str, style: str) -> None:
    """A width or precision inside a format string (``"%999999999d"``, ``"{:>999999999}"``) pads to that
    size: refuse one above the limit of number arguments before formatting."""
    if style == "%":
        numbers = [n for spec in _PERCENT_SPEC.findall(fmt) for n in spec]
    else:
        numbers = [n for spec in _BRACE_SPEC.findall(fmt) for n in _NUMBER.findall(spec)]
    most = max(meter.budget.max_chars, MAX_RANGE)
    for number in numbers:
        if number and (len(number) > 9 or int(number) > most):
            raise RenderLimitExceeded(f"the chat template formats to a width of {number}, above the limit of "
                                      f"{most} characters", "chars")


def _guard_filter(fn):
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marker
    def guarded(*args, **kwargs):
        meter = _current()
        meter.tick()
        _check_args(meter, args[1:], kwargs)  # args[0] may be a context or the filtered value
        return meter.sized(fn(*args, **kwargs), "a filter result")

    return guarded


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every unit of work metered (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _guard_filter(fn) for name, fn in self.filters.items()}
        self.filters[ITER_FILTER] = _iter_guard
        self.filters[SIZE_FILTER] = _size_guard

    def add_filter(self, name: str, fn) -> None:
        """Install a filter, metered like the built-in ones."""
        self.filters[name] = _guard_filter(fn)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _InsertGuards().visit(super()._parse(source, name, filename))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        meter = _current()
        meter.tick()
        _check_args(meter, args, kwargs)
        _estimate_call(meter, __obj, args)
        return meter.sized(super().call(__context, __obj, *args, **kwargs), "a call result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        meter = _current()
        meter.tick()
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_numbers(meter, obj, "{")  # the sandbox hands back a wrapper that no longer names its string
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _current().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        meter = _current()
        meter.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _sized_len(seq) and isinstance(count, int):
                    meter.size(len(seq) * max(0, count), "a repeated value")
        elif operator == "+":
            meter.size(_sized_len(left) + _sized_len(right), "a concatenation")
        elif operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
            # the result's size in digits, before computing it
            if abs(left) > 1 and right > 0 and right * math.log10(abs(left)) > 4096:
                raise RenderLimitExceeded("the chat template raises a number to a power over 4096 digits", "chars")
        elif operator == "%" and isinstance(left, str):
            _check_numbers(meter, left, "%")
            _check_args(meter, right if isinstance(right, tuple) else (right,), {})
        return meter.sized(super().call_binop(context, operator, left, right), "a value")
