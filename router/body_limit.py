"""A request-body size limit for the HTTP API (RouterConfig.max_body_bytes, `--max-body-bytes`):
a larger body is answered 413 with an OpenAI-style JSON error before anything parses it.

A pure ASGI middleware: a declared Content-Length over the limit is refused at once; a body
without one (chunked) is read up to the limit and then handed on, or refused when it goes over.
"""

from __future__ import annotations

from router.asgi import send_json

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any prompt a context of 10^5 tokens allows


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False  # the server refuses a malformed Content-Length itself
            if too_big:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:  # no Content-Length: buffer up to the limit, then replay
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = {"error": {"message": f"request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                          "type": "invalid_request_error", "param": None, "code": 413}}
        await send_json(send, 413, body, headers=((b"connection", b"close"),))
