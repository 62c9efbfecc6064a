"""Query-string values from clients, parsed so that no text a client sends can raise past a view.

``str.isdigit`` accepts characters ``int`` refuses (``²``) and ``int`` accepts numbers no database
column holds, so numbers are read as ASCII digits within bounds; text loses the NUL characters that
PostgreSQL refuses in a string literal (the console), or is refused with them (``QueryText``: a 422
at the admin API).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

BIGINT_MAX = 2**63 - 1  # the largest value a BIGINT (an event seq, a primary key) holds


def query_int(raw: str | None, *, low: int = 0, high: int = BIGINT_MAX) -> int | None:
    """``raw`` as an int in ``[low, high]`` when it is plain ASCII digits (an optional leading ``-``,
    surrounding spaces allowed); ``None`` for anything else (a Unicode digit, a fraction, a number out
    of bounds)."""
    text = (raw or "").strip()
    digits = text[1:] if text.startswith("-") else text
    if not digits or not digits.isascii() or not digits.isdigit() or len(digits) > len(str(BIGINT_MAX)):
        return None
    value = int(text)
    return value if low <= value <= high else None


def query_text(raw: str | None, *, max_len: int) -> str:
    """``raw`` stripped, without NUL characters, cut to ``max_len`` characters."""
    return (raw or "").replace("\x00", "").strip()[:max_len]


# Free text in an admin API query parameter (a filter compared with a column): bounded, no NUL.
QueryText = Annotated[str, Field(max_length=200, pattern=r"^[^\x00]*$")]
# A row number in a query parameter (an event seq to page before): what a BIGINT column holds.
QueryRowNumber = Annotated[int, Field(ge=0, le=BIGINT_MAX)]
