"""The engine thread's loop: every command from the event loop and every step of the
batch (which turn is admitted when is the :class:`~._admission.Admission`'s; the agents'
caches themselves are the :class:`~..residency._manager.CacheManager`'s)."""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable
from typing import Any

from ...errors import (
    EngineError,
    PoolExhaustedError,
    RuntimeClosedError,
)
from ..engine._engine import BlockPoolBatchEngine
from ..residency._image import CacheImage, PendingCopy, copy_to_host
from ..residency._manager import CacheManager
from . import _events as events
from ._admission import Admission
from ._protocol import (
    SHUTDOWN,
    Adopt,
    Cancel,
    Commit,
    Forget,
    Fork,
    Pin,
    Prefetched,
    Query,
    Release,
    Save,
    SchedulerStatistics,
    Stored,
    Submit,
    Turn,
    Undo,
    WriteFailed,
)

#: One step's events for the event loop, in order.
Outbox = list[events.Event]


class EngineLoop:
    """Runs on the engine thread until it reads the shutdown command.

    Commands are applied in the order they were sent. An idle loop blocks on the
    command queue; a busy one takes what arrived since the last step. Whatever the
    event loop must hear (text, results, failures, caches to write) goes into one
    outbox per step, handed over by ``deliver``.

    A turn the pool has no room for while other turns are in flight waits, in order of
    arrival (:class:`Admission`), until one of them finishes and frees (or makes
    evictable) what it held; it is refused with :class:`PoolExhaustedError` only when
    nothing in flight could make room. Its caller's timeout bounds the wait.
    """

    def __init__(
        self,
        engine: BlockPoolBatchEngine,
        caches: CacheManager,
        outbox: Outbox,
        commands: queue.SimpleQueue[object],
        deliver: Callable[[Outbox], None],
        *,
        log: Any,
        admission_window: float,
        coming: Callable[[], int] = lambda: 0,
    ) -> None:
        self.engine = engine
        self.caches = caches
        self.pool = engine.pool
        #: What the event loop must hear, handed over after each step (the cache
        #: manager adds the caches it evicts).
        self.outbox = outbox
        self._commands = commands
        self._deliver = deliver
        self._log = log
        self._window = admission_window
        self._coming = coming
        self.turns: dict[int, Turn] = {}
        self.admission = Admission(engine, caches, outbox, self.turns, log=log)
        #: The command being applied (it is not in the queue any more).
        self.applying: object | None = None
        #: Snapshots taken by the commands applied since the last step, each with the
        #: event that hands it over; their copies to host memory, done together
        #: (:meth:`_copy_snapshots`) before the next step.
        self._snapshots: list[tuple[Callable[[CacheImage | None], events.Event], CacheImage]] = []
        self._copies: list[PendingCopy] = []

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.active
            try:
                command = self._commands.get(block=idle)
            except queue.Empty:
                command = None
            if idle and self._window > 0:
                # Turns asked together (a fan-out) trickle in over a few milliseconds
                # as their agents render them; gathering them before the first step
                # prefills them as one batch. A lone turn does not wait.
                cap = time.perf_counter() + 10 * self._window
                while command is not None:
                    if command is SHUTDOWN:
                        return
                    self.apply(command)
                    wait = min(self._window, cap - time.perf_counter())
                    try:
                        if wait > 0 and self._coming() > 0:
                            command = self._commands.get(timeout=wait)
                        else:
                            command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
            while command is not None:
                if command is SHUTDOWN:
                    return
                self.apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._snapshots:
                self._copy_snapshots()
            if engine.active:
                self._step()
            admission = self.admission
            if admission.waiting and admission.room:
                admission.admit_waiting()
            if admission.prefetcher.due:
                admission.prefetch()
            if self.outbox:
                items = self.outbox[:]
                self.outbox.clear()
                self._deliver(items)

    def apply(self, command: object) -> None:
        self.applying = command  # answered by :meth:`close` if it raises
        self._apply(command)
        self.applying = None

    def _apply(self, command: object) -> None:
        if isinstance(command, (Commit, Release, Forget, Cancel, Undo)):
            self.admission.room = True
        if isinstance(command, Submit):
            self.admission.admit(command.turn, command.image)
        elif isinstance(command, Cancel):
            self._cancel(command.turn)
        elif isinstance(command, Commit):
            self._stored(command.stored)
            image = self.caches.commit(
                command.agent,
                command.blocks,
                hold=command.hold,
                saving=command.saving,
                snapshot=bool(command.snapshot),
                later=self._copies,
            )
            if command.snapshot:
                number = command.snapshot
                self._hand_over(functools.partial(events.Snapshot, command.agent, number), image)
        elif isinstance(command, Release):
            self.caches.release(command.agent, command.blocks)
        elif isinstance(command, Undo):
            self.caches.undo(command.agent)
        elif isinstance(command, Save):
            self._stored(command.stored)
            image = self.caches.snapshot(command.agent, later=self._copies)
            self._hand_over(functools.partial(events.SaveReady, command), image)
        elif isinstance(command, WriteFailed):
            self.caches.write_failed(command.agent, command.serial)
        elif isinstance(command, Forget):
            self.caches.forget(command.agent)
        elif isinstance(command, Adopt):
            self.caches.adopt(command.agent, command.tokens)
        elif isinstance(command, Pin):
            self.caches.pin(command.agent, command.seconds)
        elif isinstance(command, Prefetched):
            self.admission.prefetcher.read_back(command.agent, command.image)
        elif isinstance(command, Fork):
            self._fork(command)
        elif isinstance(command, Query):
            self.outbox.append(events.Statistics(command.reply, self.snapshot()))

    def _hand_over(
        self, event: Callable[[CacheImage | None], events.Event], image: CacheImage | None
    ) -> None:
        """Send ``event(image)`` once the image's copies to host memory are done."""
        if image is None:
            self.outbox.append(event(None))
        else:
            self._snapshots.append((event, image))

    def _copy_snapshots(self) -> None:
        """The copies of the snapshots taken since the last step, with one wait for the
        device for all of them (a wait stops the batch's steps running ahead), then
        their events."""
        copy_to_host(self._copies)
        self._copies.clear()
        self.outbox.extend(event(image) for event, image in self._snapshots)
        self._snapshots.clear()

    def _stored(self, stored: Stored | None) -> None:
        if stored is not None:
            self.caches.stored(stored.agent, stored.refs, stored.serial)

    def _fork(self, command: Fork) -> None:
        """A new agent holding the parent's cache by reference (or, on disk, to be read
        from the parent's files)."""
        child, evicted = self.caches.fork(command.parent, command.child)
        blocks = child.blocks.num_blocks if child.blocks is not None else 0
        self._log.info(
            "agent.forked",
            agent=command.child,
            parent=command.parent,
            cached_tokens=len(child.tokens),
            shared_blocks=blocks,
            pool_used=self.pool.used_blocks,
        )
        self.outbox.append(events.Forked(command, evicted))

    # -- the rest of a turn's life ---------------------------------------------------------

    def _cancel(self, turn: Turn) -> None:
        if self.admission.cancel_waiting(turn):
            self._log.info("turn.cancelled", agent=turn.agent, turn=turn.id, waiting=True)
        if turn.uid is not None and self.turns.pop(turn.uid, None) is not None:
            self.engine.cancel(turn.uid)
            self.caches.entry(turn.agent).busy = False
            self._log.info(
                "turn.cancelled", agent=turn.agent, turn=turn.id, pool_used=self.pool.used_blocks
            )
        self.outbox.append(events.Cancelled(turn))

    def _step(self) -> None:
        engine = self.engine
        try:
            finished = engine.step()
        except EngineError as exc:
            self._log.error("batch.failed", error=str(exc), turns=len(exc.uids))
            self._refused()  # turns refused before the failure still get their answer
            for uid in exc.uids:
                turn = self.turns.pop(uid)
                self.caches.entry(turn.agent).busy = False
                self.outbox.append(events.Failed(turn, exc))
            self.admission.room = True
            return
        self._refused()
        info = engine.last_step
        if info is not None:
            self._log.debug(
                "batch.step",
                batch=info.decode_batch,
                prefill_tokens=info.prefill_tokens,
                finished=info.finished,
                ms=round(info.seconds * 1e3, 3),
                jobs=info.jobs,
                jobs_ms=round(info.jobs_seconds * 1e3, 3),
                joined=info.joined,
                batch_ms=round(info.batch_seconds * 1e3, 3),
                pool_used=self.pool.used_blocks,
                prefilled=list(info.prefilled),
                decoded=list(info.decoded),
            )
        for result in finished:
            self.admission.room = True
            turn = self.turns.pop(result.uid)
            usage = result.usage
            self._log.info(
                "turn.finished",
                agent=turn.agent,
                turn=turn.id,
                finish=result.finish_reason,
                prefill_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                generated_tokens=usage.generated_tokens,
                shared_tokens=usage.shared_tokens,
                ttft_ms=round(result.ttft_s * 1e3, 1),
                total_ms=round(result.total_s * 1e3, 1),
                pool_used=self.pool.used_blocks,
            )
            self.outbox.append(events.Finished(turn, result))

    def _refused(self) -> None:
        """Fail the turns the engine refused (waiting for a shared prefix, they could no
        longer get the blocks they need)."""
        for uid, error in self.engine.take_refused():
            turn = self.turns.pop(uid, None)
            if turn is None:
                continue
            self.caches.entry(turn.agent).busy = False
            self.admission.room = True
            if isinstance(error, PoolExhaustedError) and self.caches.others_busy(turn.agent):
                turn.uid = None  # admitted again once there is room, before later turns
                self.admission.wait_for_room(turn, None, error, first=True)
                continue
            self._log.info(
                "turn.refused", agent=turn.agent, turn=turn.id, error=type(error).__name__
            )
            self.outbox.append(events.Failed(turn, error))

    def snapshot(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            pool=self.pool.statistics(),
            engine=self.engine.statistics(),
            turns_in_flight=len(self.turns) + len(self.admission.waiting),
            **self.caches.counts(),
        )

    def close(
        self, leftovers: list[object], failure: EngineError | None = None
    ) -> SchedulerStatistics:
        """Fail every turn in flight (with ``failure`` if the loop stopped on an error),
        free every block, answer what is left unread."""
        closed: Exception = failure or RuntimeClosedError(
            "the runtime shut down before the turn finished"
        )
        for turn in [*self.turns.values(), *(turn for turn, _ in self.admission.waiting)]:
            self.outbox.append(events.Failed(turn, closed))
        self.turns.clear()
        self.admission.waiting.clear()
        if self._snapshots and failure is None:  # taken just before the shutdown
            try:
                self._copy_snapshots()
            except Exception as exc:
                self._log.error("blocks.copy_failed", error=repr(exc))
        # Snapshots not copied (the loop failed): nothing of them to save.
        self.outbox.extend(event(None) for event, _ in self._snapshots)
        self._snapshots.clear()
        self._copies.clear()
        self.engine.close()
        # Each cache once: a commit left over may bring blocks an agent already holds
        # (the one that ends a hold while a turn is saved), or come twice.
        freed = self.caches.free_all()
        for command in leftovers:
            if isinstance(command, (Release, Commit)) and id(command.blocks) not in freed:
                freed.add(id(command.blocks))
                self.pool.free(command.blocks.blocks())
        final = self.snapshot()
        for command in leftovers:
            if isinstance(command, Submit):
                self.outbox.append(events.Failed(command.turn, closed))
            elif isinstance(command, Cancel):
                self.outbox.append(events.Cancelled(command.turn))
            elif isinstance(command, Query):
                self.outbox.append(events.Statistics(command.reply, final))
            elif isinstance(command, Save):
                self.outbox.append(events.SaveReady(command, None))
            elif isinstance(command, Commit) and command.snapshot:
                self.outbox.append(events.Snapshot(command.agent, command.snapshot, None))
            elif isinstance(command, Fork):
                self.outbox.append(events.Forked(command, None))
        return final
