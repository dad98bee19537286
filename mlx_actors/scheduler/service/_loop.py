"""The engine thread's loop: every command from the event loop, every step of the batch,
and which turn is admitted when (the agents' caches themselves are the
:class:`~..residency._manager.CacheManager`'s)."""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Callable
from typing import Any

from ...errors import (
    CacheReconstructionError,
    EngineError,
    MlxActorsError,
    PoolExhaustedError,
    RuntimeClosedError,
)
from ..engine._constraint import Constraint, grammar_tokenizer
from ..engine._engine import BlockPoolBatchEngine
from ..engine._records import TokenEvent
from ..residency._image import CacheImage
from ..residency._manager import CacheEntry, CacheManager, nothing_to_evict
from ..residency._prefetch import Prefetcher
from . import _events as events
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
    arrival, until one of them finishes and frees (or makes evictable) what it held;
    it is refused with :class:`PoolExhaustedError` only when nothing in flight could
    make room. Its caller's timeout bounds the wait.
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
        #: Turns waiting for room in the pool, oldest first (with the cache read back
        #: from disk for them, if any).
        self.waiting: collections.deque[tuple[Turn, CacheImage | None]] = collections.deque()
        #: Whether blocks may have been freed since the waiting turns last tried.
        self._room = False
        #: The tokenizer as the grammar engine reads it (built at the first constraint).
        self._grammar_tokenizer: Any = None
        #: The command being applied (it is not in the queue any more).
        self.applying: object | None = None
        #: Brings back the cache of the agent expected next while turns run.
        self.prefetch = Prefetcher(caches, log=log)

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
            if engine.active:
                self._step()
            if self.waiting and self._room:
                self._admit_waiting()
            if self.prefetch.due:
                self._prefetch()
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
            self._room = True
        if isinstance(command, Submit):
            self._admit(command.turn, command.image)
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
            )
            if command.snapshot:
                self.outbox.append(events.Snapshot(command.agent, command.snapshot, image))
        elif isinstance(command, Release):
            self.caches.release(command.agent, command.blocks)
        elif isinstance(command, Undo):
            self.caches.undo(command.agent)
        elif isinstance(command, Save):
            self._stored(command.stored)
            self.outbox.append(events.SaveReady(command, self.caches.snapshot(command.agent)))
        elif isinstance(command, WriteFailed):
            self.caches.write_failed(command.agent, command.serial)
        elif isinstance(command, Forget):
            self.caches.forget(command.agent)
        elif isinstance(command, Adopt):
            self.caches.adopt(command.agent, command.tokens)
        elif isinstance(command, Pin):
            self.caches.pin(command.agent, command.seconds)
        elif isinstance(command, Prefetched):
            self.prefetch.read_back(command.agent, command.image)
        elif isinstance(command, Fork):
            self._fork(command)
        elif isinstance(command, Query):
            self.outbox.append(events.Statistics(command.reply, self.snapshot()))

    def _stored(self, stored: Stored | None) -> None:
        if stored is not None:
            self.caches.stored(stored.agent, stored.refs, stored.serial)

    # -- admission, eviction, restore ------------------------------------------------------

    def _admit(self, turn: Turn, image: CacheImage | None) -> None:
        if self.waiting:  # in order of arrival
            self._wait_for_room(turn, image, None)
        elif (short := self._try_admit(turn, image)) is not None:
            self._wait_for_room(turn, image, short)

    def _admit_waiting(self) -> None:
        """Admit the waiting turns, oldest first, while they fit."""
        self._room = False
        while self.waiting:
            turn, image = self.waiting[0]
            if self._try_admit(turn, image) is not None:
                break
            self.waiting.popleft()

    def _wait_for_room(
        self,
        turn: Turn,
        image: CacheImage | None,
        error: PoolExhaustedError | None,
        *,
        first: bool = False,
    ) -> None:
        if first:
            self.waiting.appendleft((turn, image))
        else:
            self.waiting.append((turn, image))
        self._log.info(
            "turn.waiting_for_room",
            agent=turn.agent,
            turn=turn.id,
            needed=error.needed if error is not None else None,
            pool_free=self.pool.free_blocks,
            waiting=len(self.waiting),
        )

    def _try_admit(self, turn: Turn, image: CacheImage | None) -> PoolExhaustedError | None:
        """Admit ``turn``, or answer it (refused, or its cache to read back); or, when
        the pool lacks room now but a turn in flight may make some, say how short it
        is."""
        entry = self.caches.entry(turn.agent)
        try:
            if entry.evicted:
                image = image or self.prefetch.image(turn.agent)
                if image is None:  # on disk: the event loop reads it, then sends it back
                    self.outbox.append(events.NeedsRestore(turn))
                    return None
                try:
                    self.caches.restore(turn.agent, image)
                    self.outbox.append(events.Restored(turn.agent))
                except CacheReconstructionError as exc:
                    # A cache that does not fit is never used: the agent starts over
                    # from its conversation, and the event loop deletes the files.
                    self.caches.lose(turn.agent)
                    self.outbox.append(events.RestoreFailed(turn, exc))
                    return None
                except PoolExhaustedError:
                    if self.caches.others_busy(turn.agent):
                        raise
                    # Larger than the pool can hold with nothing in flight: the turn
                    # starts from the conversation (the event loop lets the image go).
                    self._drop_cache(turn, image.num_blocks, "its saved cache")
                    self.outbox.append(events.Restored(turn.agent))
            uid = self._submit_within_pool(turn, entry)
        except MlxActorsError as exc:
            if isinstance(exc, PoolExhaustedError) and self.caches.others_busy(turn.agent):
                return exc
            self._log.info("turn.refused", agent=turn.agent, turn=turn.id, error=type(exc).__name__)
            self.outbox.append(events.Failed(turn, exc))
            return None
        except Exception as exc:
            error = EngineError(f"the engine could not take the turn: {exc!r}")
            self.outbox.append(events.Failed(turn, error))
            return None
        self.caches.started(turn.agent)
        self.prefetch.due = True  # which agent is expected next changed
        turn.uid = uid
        self.turns[uid] = turn
        return None

    def _prefetch(self) -> None:
        """Bring back the cache of the agent expected next, or ask for it to be read."""
        restored, read = self.prefetch.run()
        if restored is not None:
            self.outbox.append(events.Restored(restored))
        if read is not None:
            self.outbox.append(events.Prefetch(read))

    def _constraint(self, turn: Turn) -> list[Constraint]:
        """The logits processor that holds ``turn``'s reply to its grammar, if any."""
        if turn.grammar is None:
            return []
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(
                self.engine.tokenizer, self.engine.vocab_size
            )
        return [
            Constraint(
                self._grammar_tokenizer, turn.grammar, len(turn.tokens), self.engine.vocab_size
            )
        ]

    def _submit_within_pool(self, turn: Turn, entry: CacheEntry) -> int:
        """Submit ``turn``. If the pool cannot hold the agent's own cache beside the
        turn's new blocks, and no other cache can leave and no turn in flight free any,
        the turn starts without that cache (from what other agents' live blocks hold,
        prefilling the rest), as a fresh start from the conversation would: the cache is
        dropped, not refused with the turn (a turn the whole pool cannot hold even from
        the start is :class:`ContextLengthError`)."""
        try:
            return self._submit(turn, entry)
        except PoolExhaustedError:
            if entry.blocks is None or entry.holding or self.caches.others_busy(turn.agent):
                raise
        self._drop_cache(turn, entry.blocks.num_blocks, "its cache")
        return self._submit(turn, entry)

    def _drop_cache(self, turn: Turn, blocks: int, what: str) -> None:
        """Start ``turn`` without its agent's cache, which the pool cannot hold beside
        the turn's new blocks."""
        why = f"the pool cannot hold {what} beside the turn's new blocks"
        self.caches.drop(turn.agent, blocks, why, turn=turn.id)

    def _submit(self, turn: Turn, entry: CacheEntry) -> int:
        tokens, blocks = turn.tokens, entry.blocks
        # The engine finds the longest prefix any live blocks hold; the agent's own
        # blocks tell it which part is the agent's (and which shared with others).
        common = min(blocks.common_prefix(tokens), len(tokens) - 1) if blocks is not None else 0
        on_token = None
        if turn.on_text is not None:

            def on_token(event: TokenEvent, turn: Turn = turn) -> None:
                if event.text:
                    self.outbox.append(events.Printed(turn, event.text))

        try:
            uid = self.engine.submit(
                turn.agent,
                tokens[common:],
                blocks if common else None,
                trim=blocks.num_tokens - common if blocks is not None and common else 0,
                max_tokens=turn.max_tokens,
                sampling=turn.sampling,
                stop=turn.stop,
                on_token=on_token,
                namespace=entry.namespace,
                processors=self._constraint(turn),
            )
        except PoolExhaustedError as exc:
            own = blocks.blocks() if blocks is not None else ()  # distinct: one layer each
            raise nothing_to_evict(exc, sum(self.pool.spec.units(b.layer) for b in own)) from None
        admission = self.engine.admission(uid)
        assert admission is not None
        lost = {"not_reused": admission.not_reused} if admission.not_reused else {}
        self._log.info(
            "turn.admitted",
            agent=turn.agent,
            turn=turn.id,
            batch=self.engine.active,
            prefill_tokens=admission.prefill_tokens,
            cached_tokens=admission.cached_tokens,
            shared_tokens=admission.shared_tokens,
            reusable_tokens=admission.reusable_tokens,
            **lost,
            queued_ms=round((time.perf_counter() - turn.queued_at) * 1e3, 2),
            pool_used=self.pool.used_blocks,
            pool_free=self.pool.free_blocks,
        )
        if admission.waits_for is not None:
            self._log.info(
                "turn.waiting",
                agent=turn.agent,
                turn=turn.id,
                shared_tokens=admission.waits_tokens,
                computed_by=admission.waits_for,
            )
        return int(uid)

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
        if any(waiting is turn for waiting, _ in self.waiting):
            self.waiting = collections.deque(w for w in self.waiting if w[0] is not turn)
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
            self._room = True
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
            self._room = True
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
            self._room = True
            if isinstance(error, PoolExhaustedError) and self.caches.others_busy(turn.agent):
                turn.uid = None  # admitted again once there is room, before later turns
                self._wait_for_room(turn, None, error, first=True)
                continue
            self._log.info(
                "turn.refused", agent=turn.agent, turn=turn.id, error=type(error).__name__
            )
            self.outbox.append(events.Failed(turn, error))

    def snapshot(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            pool=self.pool.statistics(),
            engine=self.engine.statistics(),
            turns_in_flight=len(self.turns) + len(self.waiting),
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
        for turn in [*self.turns.values(), *(turn for turn, _ in self.waiting)]:
            self.outbox.append(events.Failed(turn, closed))
        self.turns.clear()
        self.waiting.clear()
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
