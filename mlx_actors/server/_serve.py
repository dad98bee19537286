"""Serving the app with uvicorn on the runtime's event loop (asyncio), until interrupted
or cancelled, shutting down gracefully either way."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import anyio
import uvicorn

from ..runtime import Runtime
from ._app import create_app

#: Seconds requests in flight get to finish once the server is told to stop (a second
#: Ctrl-C stops at once).
GRACE = 10


async def serve(
    runtime: Runtime,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    log_level: str = "warning",
    **app_options: Any,
) -> None:
    """Serve ``runtime`` (entered) over HTTP until Ctrl-C or SIGTERM, or until the caller
    is cancelled: then no new connection is taken and requests in flight get
    :data:`GRACE` seconds to finish. Runs on asyncio (uvicorn's loop).

    Args:
        host, port: where to listen, unless ``sock`` (a listening socket) is given.
        log_level: uvicorn's (``"info"`` logs each request).
        app_options: :func:`create_app`'s.
    """
    app = create_app(runtime, **app_options)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=GRACE,
    )
    server = _Server(config, runtime.log)
    stopped = anyio.Event()

    async def run() -> None:
        try:
            # Shielded: a cancel of the caller asks for a graceful stop instead.
            with anyio.CancelScope(shield=True):
                await server.serve(sockets=[sock] if sock is not None else None)
        finally:
            stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            await stopped.wait()
        finally:
            server.should_exit = True
            with anyio.CancelScope(shield=True):
                await stopped.wait()


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (IPv4 or IPv6, as ``host`` resolves)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


class _Server(uvicorn.Server):
    """uvicorn's server, whose Ctrl-C or SIGTERM stops it gracefully (a second Ctrl-C
    at once) and then returns, rather than raising the signal again."""

    def __init__(self, config: uvicorn.Config, log: Any) -> None:
        super().__init__(config)
        self._log = log

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._log.warning("server.stopping", requests_get_s=GRACE, again="stops now")
        super().handle_exit(sig, frame)
