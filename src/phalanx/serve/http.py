"""The HTTP server under the API: uvicorn, with the two deadlines it lacks (issue 45).

* **The header deadline.** uvicorn bounds the idle time between requests on a kept-alive
  connection, but cancels that timer on the first byte of the next request and has no
  other: a client sending its headers one byte a second held its connection (and, at
  50 such clients, its share of the connection limit) for as long as it liked. Here a
  connection's request head (request line and headers) must be complete within
  ``header_timeout`` seconds of the connection opening or of the previous response
  ending; past that it is answered 408 and closed, as nginx's ``client_header_timeout``
  does. The body phase is the app's (its size is capped by the guard middleware).
* **The shutdown deadline.** At SIGTERM uvicorn stops accepting and waits
  ``timeout_graceful_shutdown`` for responses to end, then cancels their tasks: a stream
  cut there ended with neither an error event nor ``[DONE]``. Here, when
  ``shutdown_timeout`` passes, every request still in flight is failed through the
  engine client first (its stream says so in an error event, then ``[DONE]``), and
  uvicorn's own deadline, a few seconds later, only cancels what still did not end.

Connections beyond ``max_connections`` are answered 503 by uvicorn's
``limit_concurrency``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HttpServer", "header_deadline_protocol"]

log = logging.getLogger("phalanx.serve")

# What uvicorn's deadline adds to ours: time for the error events to be written.
_FLUSH_GRACE_S = 3.0

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s")


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol whose request heads must arrive within ``header_timeout``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head arrived (or it broke)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head has the same deadline

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            body = (b'{"error": {"message": "the request\'s headers did not arrive within '
                    + f"{header_timeout:g}".encode() + b' s", "type": "invalid_request_error'
                    b'", "param": null, "code": "request_timeout"}}')
            self.transport.write(_TIMEOUT_408 % (len(body), body))
            self.transport.close()

    return HeaderDeadlineProtocol


class HttpServer(uvicorn.Server):
    """uvicorn's server whose shutdown fails the requests still in flight when
    ``shutdown_timeout`` passes (``fail_inflight(reason)``), before uvicorn cancels
    them a little later."""

    def __init__(self, app: Any, *, header_timeout: float, max_connections: int,
                 shutdown_timeout: float, fail_inflight: Callable[[str], int]) -> None:
        super().__init__(uvicorn.Config(
            app, http=header_deadline_protocol(header_timeout), log_level="warning",
            access_log=False, lifespan="on", limit_concurrency=max_connections,
            timeout_graceful_shutdown=int(shutdown_timeout + _FLUSH_GRACE_S + 0.999)))
        self._shutdown_timeout = shutdown_timeout
        self._fail_inflight = fail_inflight

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self._shutdown_timeout, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _expire(self) -> None:
        reason = (f"the server is shutting down and --shutdown-timeout "
                  f"({self._shutdown_timeout:g} s) passed before this request ended")
        n = self._fail_inflight(reason)
        if n:
            log.warning("shutdown: %d request(s) still in flight after %g s were ended",
                        n, self._shutdown_timeout)
