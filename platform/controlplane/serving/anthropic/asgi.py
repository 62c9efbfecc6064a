"""``AnthropicErrors`` (ASGI): on the Messages API's paths, the JSON errors that layers before its view
answer in Strata's shape (the serving gate's 401/403/429/413/503, the body limit's 413, Django's 404
and 405) are rewritten into Anthropic's (``errors.from_strata``). Only error responses are held (small
JSON bodies); anything else, streams included, passes through as it is sent."""

from __future__ import annotations

import json

from controlplane.common.asgi_limits import ASGIApp, Message, Receive, Scope, Send
from controlplane.serving.anthropic import errors

PATHS = frozenset({"/v1/messages"})


def _json(message: Message) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"application/json")
               for name, value in message.get("headers", ()))


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("path", "").rstrip("/") not in PATHS:
            return await self.app(scope, receive, send)
        held: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400 and _json(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = held["status"], b"".join(chunks)
            try:
                converted = errors.from_strata(status, json.loads(body))
            except ValueError:
                converted = None
            if converted is not None:
                status, body = converted[0], json.dumps(converted[1]).encode()
            headers = [(k, v) for k, v in held.get("headers", ()) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**held, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return await self.app(scope, receive, rewrite)
