"""uvicorn's HTTP/1.1 protocol (h11) with the limits a server facing slow or hostile clients needs and
uvicorn does not have: a connection that has not sent its request headers within ``header_timeout_s``
(after it opened, or after its previous response) is closed, and beyond ``max_connections`` open
connections a new one is answered 503 and closed at once. The body's own deadline is the app's
(``AppState.body_timeout_s``: 408). Without these, 400 connections with unfinished headers stayed
open for minutes, each holding a file descriptor.
"""
from __future__ import annotations

import asyncio
import json
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY_BODY = json.dumps({"error": {"message": "too many open connections; retry later",
                                  "type": "service_unavailable_error", "param": None,
                                  "code": "too_many_connections"}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                 b"connection: close\r\ncontent-length: " + str(len(BUSY_BODY)).encode() + b"\r\n\r\n" + BUSY_BODY)


def guarded_protocol(header_timeout_s: float, max_connections: int):
    """The protocol class for ``uvicorn.Config(http=...)``."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            self._header_timer: Optional[asyncio.TimerHandle] = None
            if len(self.connections) >= max_connections:
                transport.write(BUSY_RESPONSE)
                transport.close()
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request of ours is running
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            # the headers of a request arrived when h11 moved past waiting for them
            if self.conn.their_state is not h11.IDLE and self.cycle is not None:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same deadline (keep-alive)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            if self.flow is None:  # refused in connection_made: nothing of uvicorn's was set up
                return
            super().connection_lost(exc)

    return GuardedH11Protocol
