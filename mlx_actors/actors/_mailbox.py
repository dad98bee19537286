"""An agent's mailbox and the task that takes its envelopes: one at a time, in order,
each run by its kind's handler in a cancel scope of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio
from anyio.abc import TaskStatus

from ..errors import AgentClosedError, MlxActorsError, RuntimeClosedError
from ._envelope import Envelope, handling

#: What runs one kind of request (``"ask"``, ``"respond"``, ``"tell"``, ``"fork"``,
#: ``"reset"``): it raises what the request's caller gets.
Handler = Callable[[Envelope], Awaitable[None]]


class Mailbox:
    """A bounded mailbox (a full one makes senders wait) and the task that empties it.

    When the task ends (a stop, or the runtime shutting down) the requests still queued,
    and the senders still waiting, fail with the error the mailbox was stopped with.
    """

    def __init__(
        self,
        name: str,
        size: int,
        *,
        handlers: Mapping[str, Handler],
        deliver: Handler,
        on_stopped: Callable[[], None],
    ) -> None:
        self.name = name
        self._handlers = handlers
        #: Waits for the caller of a request whose outcome is on its way (see
        #: ``Envelope.delivering``).
        self._deliver = deliver
        self._on_stopped = on_stopped
        self._send, self._receive = anyio.create_memory_object_stream[Envelope](size)
        self._abandoned = 0  # cancelled requests still in the mailbox
        self._scope = anyio.CancelScope()
        self._stopped = anyio.Event()
        #: Why the mailbox takes no more requests (``None``: it still does).
        self.closing: MlxActorsError | None = None

    def queued(self) -> int:
        """Requests waiting in the mailbox (the running one and cancelled ones not
        included)."""
        return self._send.statistics().current_buffer_used - self._abandoned

    def senders_waiting(self) -> int:
        """Tasks waiting to put a request into the full mailbox."""
        return self._send.statistics().tasks_waiting_send

    async def put(self, envelope: Envelope) -> None:
        """Put ``envelope`` in the mailbox (waits while it is full).

        Raises:
            anyio.ClosedResourceError, anyio.BrokenResourceError: the mailbox takes no
                more requests (see :meth:`closed_error`).
        """
        await self._send.send(envelope)

    def withdraw(self) -> None:
        """A request in the mailbox was cancelled: the task will skip it."""
        self._abandoned += 1

    def closed_error(self) -> MlxActorsError:
        """The error of a request that comes after the agent stopped."""
        if isinstance(self.closing, RuntimeClosedError):
            return RuntimeClosedError(
                f"agent {self.name!r} takes no more requests: its runtime has shut down "
                "(call agents inside `async with Runtime(...) as rt:`)"
            )
        return self.closing or AgentClosedError(f"agent {self.name!r} is closed")

    async def stop(self, error: MlxActorsError, *, wait: bool = True) -> None:
        """Cancel the running turn, fail the queued ones with ``error`` and end the task;
        with ``wait``, until it has ended."""
        if self.closing is None:
            self.closing = error
            self._send.close()
            self._scope.cancel()
        if wait:
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The agent's task: take envelopes from the mailbox, one at a time."""
        try:
            with self._scope:
                task_status.started()
                async for envelope in self._receive:
                    envelope.in_mailbox = False
                    if envelope.cancelled:
                        self._abandoned -= 1
                    else:
                        await self._handle(envelope)
        finally:
            self.closing = self.closing or RuntimeClosedError("the runtime shut down")
            self._send.close()
            # Answer what is still queued, then close: blocked senders get the error too.
            while True:
                try:
                    envelope = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                envelope.error = self.closing
                envelope.finish()
            self._receive.close()
            self._stopped.set()
            self._on_stopped()

    async def _handle(self, envelope: Envelope) -> None:
        token = handling.set((*envelope.senders, envelope))
        try:
            with anyio.CancelScope() as envelope.scope:
                try:
                    await self._handlers[envelope.kind](envelope)
                    envelope.completed = True
                except Exception as exc:
                    envelope.error = exc
        finally:
            if not envelope.completed and envelope.error is None:
                envelope.error = self.closing or MlxActorsError("the turn was cancelled")
            handling.reset(token)
            envelope.finish()
        if envelope.delivering:
            await self._deliver(envelope)
