"""Server-sent events that stop generating the moment the client goes away.

Starlette's ``StreamingResponse`` notices a disconnect only when its next write fails, and then leaves the body
iterator suspended until garbage collection. :class:`EventStreamResponse` instead watches the connection while it
streams, and closes the event iterator as soon as the client is gone: that runs the iterator's ``finally`` blocks,
which abort the engine requests, so their KV blocks are freed before the next engine step.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, Callable

from starlette.types import Receive, Scope, Send

from rtxcore.server.serving.formats import event_text

log = logging.getLogger("rtx.http")

DONE = b"data: [DONE]\n\n"


def sse_data(payload: Any) -> bytes:
    """One ``data:`` event (no id)."""
    return b"data: " + event_text(payload).encode() + b"\n\n"


def sse_event(seq: int, text: str) -> bytes:
    """One event with its id (``Last-Event-ID`` on reconnection) and the payload as :func:`event_text` made it."""
    return b"id: %d\ndata: " % seq + text.encode() + b"\n\n"


class EventStreamResponse:
    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None):
        """:param on_close: called once streaming is over, however it ended (even if ``events`` never started).
        :param headers: sent besides the event-stream ones."""
        self.events = events
        self.on_close = on_close
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *self.headers,
        ]})
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream.cancel()
            watch.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            try:
                await self.events.aclose()  # the client left mid-stream: this aborts its engine requests
            finally:
                if self.on_close is not None:
                    self.on_close()
        exc = None if stream.cancelled() else stream.exception()
        if isinstance(exc, Exception) and not isinstance(exc, OSError):
            raise exc  # a write to a closed connection (OSError) is a disconnect, not a bug

    async def _stream(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
