"""Operator token reads."""

from __future__ import annotations

from controlplane.common.tokens import secret_matches, secret_prefix
from controlplane.operators.models import OperatorToken


def operator_authenticate(raw_token: str) -> OperatorToken | None:
    """The live token matching ``raw_token`` (prefix lookup, constant-time digest compare) or
    ``None`` for unknown and revoked tokens alike."""
    if not isinstance(raw_token, str) or not raw_token:
        return None
    match = None
    candidates = list(OperatorToken.objects.filter(prefix=secret_prefix(raw_token)))
    for token in candidates or [None]:
        if secret_matches(raw_token, token.token_hash if token else None) and match is None:
            match = token
    if match is None or match.revoked_at is not None:
        return None
    return match


def operator_token_list() -> list[OperatorToken]:
    return list(OperatorToken.objects.all())
