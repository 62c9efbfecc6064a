"""The text of a generation, decoded incrementally, and OpenAI ``stop`` sequences cut out of it.

A token event's text is what the token adds to the decoded completion, not ``decode([token])``: a
byte-level BPE token may hold part of a UTF-8 character (decoded alone it is U+FFFD) and SentencePiece
tokens change the text before them. ``TextStream`` decodes a short window of ids (as vLLM's
detokenizer does) and emits text only once it is complete, so the emitted pieces join to
``tokenizer.decode(all ids)``.

With stop sequences, text that could be the beginning of one is held back until it is clear; when the
decoded text contains a stop sequence, generation ends (``finish_reason`` "stop") and the returned
text stops right before it (the stop sequence itself is not returned).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

MAX_STOPS = 4
MAX_STOP_CHARS = 256


def normalize_stops(stop: object) -> tuple[str, ...]:
    """``stop`` as the API accepts it (None, a string or a list of up to ``MAX_STOPS`` non-empty strings
    of at most ``MAX_STOP_CHARS``) as a tuple; ``ValueError`` for anything else."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or len(items) > MAX_STOPS:
        raise ValueError(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    for s in items:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise ValueError(f"each stop sequence must be a non-empty string of at most {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(items))


class TextStream:
    """Push generated ids one at a time; each push returns the text that may be emitted now.

    ``stopped`` becomes True when the text contains one of ``stops``; nothing after it is ever
    emitted. ``finish()`` returns the text still held back (an incomplete character, a possible stop
    prefix) once generation ended without a stop.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters)
        self.sent = 0  # characters of text already emitted
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text
        self._prefix = 0  # ids[_prefix:_read] is the context window for decoding the next id
        self._read = 0

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    @property
    def pending(self) -> bool:
        """Whether text is held back or ids are not yet decoded (``finish`` would return something)."""
        return not self.stopped and (self.sent < len(self.text) or self._read < len(self.ids))

    def finish(self) -> str:
        """The held-back rest (undecodable trailing bytes come out as U+FFFD, as ``decode`` gives them)."""
        if self.stopped:
            return ""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        self.text += after[len(before):]
        self._prefix = self._read = len(self.ids)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        hits = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in self.stops) if i >= 0]
        if hits:
            end, self.matched = min(hits, key=lambda h: h[0])
            out, self.sent, self.stopped = self.text[self.sent:end], end, True
            return out
        end = len(self.text)
        if not final:
            end -= self._held()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest unsent suffix of the text that begins a stop sequence."""
        tail = self.text[self.sent:]
        for k in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0


def apply_stops(events: Iterator[dict], tokenizer, stop: object) -> Iterator[dict]:
    """The worker's event stream with incrementally decoded token text and ``stop`` applied.

    Token events stay one per generated token; a token whose text is not yet certain (part of a
    character, a possible stop prefix) is held until the next one arrives or generation ends, and the
    held-back text goes out with a later event. On a stop the token event that completed it carries
    the text before the stop sequence, a ``finished`` event with ``finish_reason`` "stop" follows
    (usage counts the tokens generated), and ``events`` is closed, which ends the generation and
    releases its blocks. Raises ``ValueError`` for a malformed ``stop`` before anything runs.
    """
    stream = TextStream(tokenizer, normalize_stops(stop))
    prefilled: dict = {}
    generated = 0
    held: dict | None = None
    try:
        for ev in events:
            kind = ev.get("type")
            if kind == "prefilled":
                prefilled = ev
            elif kind == "token":
                generated += 1
                if held is not None:
                    yield held
                    held = None
                ev = {**ev, "text": stream.push(ev["id"])}
                if stream.stopped:
                    yield ev
                    prompt, cached = prefilled.get("prompt_tokens", 0), prefilled.get("cached_tokens", 0)
                    yield {"type": "finished", "finish_reason": "stop", "revision": prefilled.get("revision"),
                           "stop_sequence": stream.matched,
                           "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                                     "total_tokens": prompt + generated, "cached_tokens": cached}}
                    return
                if stream.pending:
                    held = ev
                    continue
            elif held is not None:  # finished or error: the held token takes the rest of the text
                yield {**held, "text": held["text"] + stream.finish()}
                held = None
            yield ev
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
