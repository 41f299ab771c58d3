"""A cap on request bodies (--max-body-bytes), enforced before a body is held in memory.

A declared Content-Length over the cap is refused from the headers alone, unread; a chunked body
is counted as it arrives and refused at the first byte past the cap. Either way the answer is a
413 in OpenAI's error shape and the connection is closed, so the rest of the body is never read.
A body within the cap is read whole here and handed on as one message, as the JSON routes would
read it anyway.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clients.openai_gateway.errors import GatewayError

DEFAULT_MAX_BODY_BYTES = 16 << 20


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Request(scope).headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"the request body is {int(declared):,} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                # The client left before its body arrived: nobody to answer.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"the request body is over {self.max_bytes:,} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        chunks.clear()
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        error = GatewayError(
            413,
            f"{what}; this gateway takes at most {self.max_bytes:,} (--max-body-bytes)",
            code="request_too_large",
            # The unread rest of the body would otherwise be parsed as the next request.
            headers={"Connection": "close"},
        )
        await error.response(Request(scope))(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the connection's own messages (its disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
