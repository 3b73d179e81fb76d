"""Helpers for the router's pure ASGI middlewares (router/auth.py, router/body_limit.py), which
answer a request themselves before any route runs. No torch."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_json(send: Send, status: int, body: dict, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer with `body` as JSON (UTF-8, Content-Type and Content-Length set) and HTTP `status`;
    `headers`: extra (name, value) pairs, lower-case bytes as ASGI wants them."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})
