"""The engine thread: every command from the event loop, every step of the batch, and the
agents' caches (resident as blocks, or moved to disk when the pool runs short)."""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Callable
from typing import Any

import attrs

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
from ..kv._pool import AgentBlocks, KVBlock
from ..residency._image import CacheImage, make_blocks, stored_ids, take_image
from . import _events as events
from ._protocol import (
    SHUTDOWN,
    Adopt,
    Cancel,
    Commit,
    Forget,
    Fork,
    Query,
    Release,
    Save,
    SchedulerStatistics,
    Stored,
    Submit,
    Turn,
    Undo,
)

#: One step's events for the event loop, in order.
Outbox = list[events.Event]


@attrs.define(eq=False)
class _Entry:
    """One agent's cache: resident as blocks, or on disk (``blocks is None``)."""

    tokens: tuple[int, ...] = ()
    blocks: AgentBlocks | None = None
    last_used: float = 0.0
    #: A turn of the agent is queued, running, or finished and not yet committed.
    busy: bool = False
    #: The serial of the agent's latest snapshot for the store.
    snapshot: int = 0
    #: Ids of the agent's blocks whose data its saved cache already holds, and where.
    stored: dict[int, str] = attrs.Factory(dict)
    #: Which blocks the agent may share (every agent's, unless sharing is off: then
    #: its own and its forks').
    namespace: object = None
    #: A turn of several rounds (tool calls) is under way: the cache it started from
    #: (``kept``, ``None`` if there was none) waits for its end, and the agent is not
    #: evicted meanwhile.
    holding: bool = False
    kept: AgentBlocks | None = None

    def busy_or_holding(self) -> bool:
        return self.busy or self.holding


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
        commands: queue.SimpleQueue[object],
        deliver: Callable[[Outbox], None],
        *,
        log: Any,
        admission_window: float,
        persistent_store: bool,
        coming: Callable[[], int] = lambda: 0,
        whole_evictions: bool = False,
    ) -> None:
        self.engine = engine
        self.pool = engine.pool
        self._commands = commands
        self._deliver = deliver
        self._log = log
        self._window = admission_window
        self._coming = coming
        self._persistent = persistent_store
        #: Evicted caches carry every block (for host memory), not only unstored ones.
        self._whole_evictions = whole_evictions
        self._dtype = engine.spec.layers[0].stored_dtype
        self.agents: dict[str, _Entry] = {}
        self.turns: dict[int, Turn] = {}
        #: Turns waiting for room in the pool, oldest first (with the cache read back
        #: from disk for them, if any).
        self.waiting: collections.deque[tuple[Turn, CacheImage | None]] = collections.deque()
        #: Whether blocks may have been freed since the waiting turns last tried.
        self._room = False
        #: The tokenizer as the grammar engine reads it (built at the first constraint).
        self._grammar_tokenizer: Any = None
        engine.make_room = self._make_room
        self.outbox: Outbox = []
        self.evictions = self.restores = 0
        self._serial = 0

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
            if self.outbox:
                items, self.outbox = self.outbox, []
                self._deliver(items)

    def apply(self, command: object) -> None:
        if isinstance(command, (Commit, Release, Forget, Cancel, Undo)):
            self._room = True
        if isinstance(command, Submit):
            self._admit(command.turn, command.image)
        elif isinstance(command, Cancel):
            self._cancel(command.turn)
        elif isinstance(command, Commit):
            self._commit(command)
        elif isinstance(command, Release):
            self.pool.free(command.blocks.blocks())
            self._entry(command.agent).busy = False
        elif isinstance(command, Undo):
            self._undo(command.agent)
        elif isinstance(command, Save):
            self._save(command)
        elif isinstance(command, Stored):
            # Only the latest snapshot's files are sure to stay: a later save rewrites
            # the blocks an earlier one wrote, and deletes the earlier chunks.
            entry = self.agents.get(command.agent)
            if self._persistent and entry is not None and entry.snapshot == command.serial:
                held = {b.id for b in entry.blocks.blocks()} if entry.blocks is not None else ()
                entry.stored.update((k, ref) for k, ref in command.refs.items() if k in held)
        elif isinstance(command, Forget):
            self.engine.forget(command.agent)
            entry = self.agents.pop(command.agent, None)
            if entry is not None:
                self._free_entry(entry)
        elif isinstance(command, Adopt):
            self.agents[command.agent] = _Entry(
                tokens=command.tokens, namespace=self._namespace(command.agent)
            )
        elif isinstance(command, Fork):
            self._fork(command)
        elif isinstance(command, Query):
            self.outbox.append(events.Statistics(command.reply, self.snapshot()))

    # -- admission, eviction, restore ------------------------------------------------------

    def _entry(self, agent: str) -> _Entry:
        entry = self.agents.get(agent)
        if entry is None:
            entry = self.agents[agent] = _Entry(namespace=self._namespace(agent))
        return entry

    def _namespace(self, agent: str) -> object:
        return None if self.engine.share_prefixes else agent

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

    def _others_busy(self, agent: str) -> bool:
        """Whether another agent's turn is in the engine (it will free or release blocks
        when it finishes). An agent between rounds of tool calls does not count: its
        next round may wait on the very room a waiting turn wants, or its tool on that
        turn, so waiting for it could wait forever."""
        return any(e.busy for name, e in self.agents.items() if name != agent)

    def _try_admit(self, turn: Turn, image: CacheImage | None) -> PoolExhaustedError | None:
        """Admit ``turn``, or answer it (refused, or its cache to read back); or, when
        the pool lacks room now but a turn in flight may make some, say how short it
        is."""
        entry = self._entry(turn.agent)
        try:
            if entry.blocks is None and entry.tokens:
                if image is None:  # on disk: the event loop reads it, then sends it back
                    self.outbox.append(events.NeedsRestore(turn))
                    return None
                try:
                    self._restore(turn.agent, entry, image)
                except CacheReconstructionError as exc:
                    # A cache that does not fit is never used: the agent starts over
                    # from its conversation, and the event loop deletes the files.
                    entry.tokens = ()
                    self.outbox.append(events.RestoreFailed(turn, exc))
                    return None
                except PoolExhaustedError:
                    if self._others_busy(turn.agent):
                        raise
                    # Larger than the pool can hold with nothing in flight: the turn
                    # starts from the conversation (the event loop lets the image go).
                    self._drop_cache(turn, entry, image.num_blocks, "its saved cache")
                    self.outbox.append(events.Restored(turn.agent))
            uid = self._submit_within_pool(turn, entry)
        except MlxActorsError as exc:
            if isinstance(exc, PoolExhaustedError) and self._others_busy(turn.agent):
                return exc
            self._log.info("turn.refused", agent=turn.agent, turn=turn.id, error=type(exc).__name__)
            self.outbox.append(events.Failed(turn, exc))
            return None
        except Exception as exc:
            error = EngineError(f"the engine could not take the turn: {exc!r}")
            self.outbox.append(events.Failed(turn, error))
            return None
        entry.busy = True
        turn.uid = uid
        self.turns[uid] = turn
        return None

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

    def _submit_within_pool(self, turn: Turn, entry: _Entry) -> int:
        """Submit ``turn``. If the pool cannot hold the agent's own cache beside the
        turn's new blocks, and no other cache can leave and no turn in flight free any,
        the turn starts without that cache (from what other agents' live blocks hold,
        prefilling the rest), as a fresh start from the conversation would: the cache is
        dropped, not refused with the turn (a turn the whole pool cannot hold even from
        the start is :class:`ContextLengthError`)."""
        try:
            return self._submit(turn, entry)
        except PoolExhaustedError:
            if entry.blocks is None or entry.holding or self._others_busy(turn.agent):
                raise
        self._drop_cache(turn, entry, entry.blocks.num_blocks, "its cache")
        return self._submit(turn, entry)

    def _drop_cache(self, turn: Turn, entry: _Entry, blocks: int, what: str) -> None:
        """Start ``turn`` without its agent's cache, which the pool cannot hold beside
        the turn's new blocks: free what the pool holds of it and forget it."""
        self._free_entry(entry)
        entry.tokens, entry.stored = (), {}
        self._log.info(
            "blocks.dropped",
            agent=turn.agent,
            turn=turn.id,
            blocks=blocks,
            reason=f"the pool cannot hold {what} beside the turn's new blocks",
        )

    def _submit(self, turn: Turn, entry: _Entry) -> int:
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
            raise _nothing_to_evict(exc, sum(self.pool.spec.units(b.layer) for b in own)) from None
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

    def _make_room(self, agent: str) -> bool:
        return self._evict_one(exclude=agent)

    def _with_room(self, agent: str, attempt: Callable[[], Any]) -> Any:
        """Run ``attempt``; while the pool is short, move the least recently used idle
        agent's cache to disk and try again."""
        while True:
            try:
                return attempt()
            except PoolExhaustedError as exc:
                if not self._evict_one(exclude=agent):
                    raise _nothing_to_evict(exc) from None

    def _evict_one(self, exclude: str) -> bool:
        """Move the least recently used idle agent's cache to disk, among those whose
        cache holds a block nobody else does; failing that, among those holding a block
        that only idle agents hold (a parent and its fork: evicting them all frees it).
        Evicting any other frees nothing."""
        idle = {
            name: entry
            for name, entry in self.agents.items()
            if entry.blocks is not None and not entry.busy_or_holding() and name != exclude
        }
        alone = [
            (entry.last_used, name)
            for name, entry in idle.items()
            if entry.blocks is not None
            and any(self.pool.references(b) == 1 for b in entry.blocks.blocks())
        ]
        name = min(alone)[1] if alone else self._evictable_together(idle)
        if name is None:
            return False
        entry = self.agents[name]
        assert entry.blocks is not None
        started = time.perf_counter()
        image = self._take_image(entry, whole=self._whole_evictions)
        blocks = entry.blocks.num_blocks
        self.pool.free(entry.blocks.blocks())
        entry.blocks = None
        self.evictions += 1
        self._log.info(
            "blocks.evicted",
            agent=name,
            blocks=blocks,
            bytes=image.nbytes,
            ms=round((time.perf_counter() - started) * 1e3, 2),
            pool_used=self.pool.used_blocks,
        )
        self.outbox.append(events.Evicted(name, image))
        return True

    def _evictable_together(self, idle: dict[str, _Entry]) -> str | None:
        """The least recently used of the ``idle`` agents holding a block that no one
        else holds (no turn, no other agent), if any."""
        holders: collections.Counter[int] = collections.Counter()
        blocks: dict[int, KVBlock] = {}
        for entry in idle.values():
            assert entry.blocks is not None
            for block in entry.blocks.blocks():
                holders[block.id] += 1
                blocks[block.id] = block
        freed = {i for i, n in holders.items() if self.pool.references(blocks[i]) == n}
        candidates = [
            (entry.last_used, name)
            for name, entry in idle.items()
            if entry.blocks is not None and any(b.id in freed for b in entry.blocks.blocks())
        ]
        return min(candidates)[1] if candidates else None

    def _restore(self, agent: str, entry: _Entry, image: CacheImage) -> None:
        started = time.perf_counter()
        if image.tokens != entry.tokens:
            raise CacheReconstructionError(
                f"the saved cache of agent {agent!r} holds {len(image.tokens)} tokens that "
                f"are not the {len(entry.tokens)} its index names"
            )
        blocks = make_blocks(
            self.pool,
            image,
            lambda n: self._with_room(agent, lambda: self.pool.reserve(n)),
            index=self.engine.index,
            namespace=entry.namespace,
        )
        entry.blocks = blocks
        if self._persistent:
            entry.stored = stored_ids(image, blocks)
        self.restores += 1
        self._log.info(
            "blocks.restored",
            agent=agent,
            blocks=blocks.num_blocks,
            bytes=image.nbytes,
            ms=round((time.perf_counter() - started) * 1e3, 2),
            pool_used=self.pool.used_blocks,
        )
        self.outbox.append(events.Restored(agent))

    def _take_image(self, entry: _Entry, *, whole: bool = False) -> CacheImage:
        assert entry.blocks is not None
        self._serial += 1
        entry.snapshot = self._serial
        return take_image(entry.blocks, entry.stored, self._dtype, self._serial, whole=whole)

    def _fork(self, command: Fork) -> None:
        """A new agent holding the parent's cache by reference (or, on disk, to be read
        from the parent's files)."""
        parent = self._entry(command.parent)
        stale = self.agents.get(command.child)
        if stale is not None:  # never leak what it held
            self._free_entry(stale)
        child = self.agents[command.child] = _Entry(
            tokens=parent.tokens,
            blocks=self.engine.share(parent.blocks) if parent.blocks is not None else None,
            last_used=time.perf_counter(),
            namespace=parent.namespace,
        )
        blocks = child.blocks.num_blocks if child.blocks is not None else 0
        self._log.info(
            "agent.forked",
            agent=command.child,
            parent=command.parent,
            cached_tokens=len(child.tokens),
            shared_blocks=blocks,
            pool_used=self.pool.used_blocks,
        )
        self.outbox.append(events.Forked(command, parent.blocks is None and bool(parent.tokens)))

    # -- the rest of a turn's life ---------------------------------------------------------

    def _cancel(self, turn: Turn) -> None:
        if any(waiting is turn for waiting, _ in self.waiting):
            self.waiting = collections.deque(w for w in self.waiting if w[0] is not turn)
            self._log.info("turn.cancelled", agent=turn.agent, turn=turn.id, waiting=True)
        if turn.uid is not None and self.turns.pop(turn.uid, None) is not None:
            self.engine.cancel(turn.uid)
            self._entry(turn.agent).busy = False
            self._log.info(
                "turn.cancelled", agent=turn.agent, turn=turn.id, pool_used=self.pool.used_blocks
            )
        self.outbox.append(events.Cancelled(turn))

    def _commit(self, command: Commit) -> None:
        entry = self._entry(command.agent)
        if command.hold and not entry.holding:
            entry.holding, entry.kept = True, entry.blocks  # the turn's start, for Undo
        elif entry.blocks is not None and entry.blocks is not command.blocks:
            self.pool.free(entry.blocks.blocks())  # (the same blocks: the hold ends)
        if not command.hold:
            if entry.kept is not None:
                self.pool.free(entry.kept.blocks())
            entry.holding, entry.kept = False, None
        entry.blocks, entry.tokens = command.blocks, command.blocks.tokens
        entry.last_used, entry.busy = time.perf_counter(), command.saving
        if entry.stored:  # only the blocks it still holds can be referred to
            entry.stored = {
                b.id: entry.stored[b.id] for b in entry.blocks.blocks() if b.id in entry.stored
            }

    def _undo(self, agent: str) -> None:
        entry = self.agents.get(agent)
        if entry is None or not entry.holding:
            return
        if entry.blocks is not None:
            self.pool.free(entry.blocks.blocks())
        entry.blocks, entry.kept, entry.holding = entry.kept, None, False
        entry.tokens = entry.blocks.tokens if entry.blocks is not None else ()
        entry.busy = False
        # Saved blocks the store holds are those of the cache the turn started from.
        held = {b.id for b in entry.blocks.blocks()} if entry.blocks is not None else set()
        entry.stored = {k: v for k, v in entry.stored.items() if k in held}

    def _free_entry(self, entry: _Entry) -> None:
        for blocks in (entry.blocks, entry.kept):
            if blocks is not None:
                self.pool.free(blocks.blocks())
        entry.blocks = entry.kept = None
        entry.holding = False

    def _save(self, command: Save) -> None:
        entry = self.agents.get(command.agent)
        image = None
        if entry is not None and entry.blocks is not None:
            image = self._take_image(entry)
        self.outbox.append(events.SaveReady(command, image))

    def _step(self) -> None:
        engine = self.engine
        try:
            finished = engine.step()
        except EngineError as exc:
            self._log.error("batch.failed", error=str(exc), turns=len(exc.uids))
            self._refused()  # turns refused before the failure still get their answer
            for uid in exc.uids:
                turn = self.turns.pop(uid)
                self._entry(turn.agent).busy = False
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
            self._entry(turn.agent).busy = False
            self._room = True
            if isinstance(error, PoolExhaustedError) and self._others_busy(turn.agent):
                turn.uid = None  # admitted again once there is room, before later turns
                self._wait_for_room(turn, None, error, first=True)
                continue
            self._log.info(
                "turn.refused", agent=turn.agent, turn=turn.id, error=type(error).__name__
            )
            self.outbox.append(events.Failed(turn, error))

    def snapshot(self) -> SchedulerStatistics:
        holders: dict[int, int] = {}
        sizes: dict[int, int] = {}
        resident = 0
        for entry in self.agents.values():
            if entry.blocks is not None:
                resident += 1
                for b in entry.blocks.blocks():
                    holders[b.id] = holders.get(b.id, 0) + 1
                    sizes[b.id] = self.pool.spec.layers[b.layer].block_bytes
        held = sum(holders.values())
        return SchedulerStatistics(
            pool=self.pool.statistics(),
            engine=self.engine.statistics(),
            turns_in_flight=len(self.turns) + len(self.waiting),
            resident_agents=resident,
            resident_blocks=len(holders),
            agent_blocks=held,
            shared_bytes=sum((n - 1) * sizes[i] for i, n in holders.items()),
            shared_blocks=sum(1 for n in holders.values() if n > 1),
            agents_on_disk=sum(1 for e in self.agents.values() if e.blocks is None and e.tokens),
            evictions=self.evictions,
            restores=self.restores,
        )

    def close(self, leftovers: list[object]) -> SchedulerStatistics:
        """Fail every turn in flight, free every block, answer what is left unread."""
        closed = RuntimeClosedError("the runtime shut down before the turn finished")
        for turn in [*self.turns.values(), *(turn for turn, _ in self.waiting)]:
            self.outbox.append(events.Failed(turn, closed))
        self.turns.clear()
        self.waiting.clear()
        self.engine.close()
        # Each cache once: a commit left over may bring blocks an agent already holds
        # (the one that ends a hold while a turn is saved), or come twice.
        freed = {id(b) for e in self.agents.values() for b in (e.blocks, e.kept) if b is not None}
        for entry in self.agents.values():
            self._free_entry(entry)
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
            elif isinstance(command, Fork):
                self.outbox.append(events.Forked(command, None))
        return final


def _nothing_to_evict(exc: PoolExhaustedError, own: int = 0) -> PoolExhaustedError:
    """``exc`` once nothing could be moved to disk; ``own``: the units of the turn's own
    cache, which stays in the pool until the turn ends."""
    mine = (
        f" This agent's own cache holds {own} of the used ones: it stays until the turn "
        "ends, beside the turn's new blocks. Every other cache"
        if own
        else " Every cache"
    )
    return PoolExhaustedError(
        f"{exc}.{mine} left in the pool belongs to an agent with a turn in flight (or is "
        "shared with one), so none could be moved to disk.",
        needed=exc.needed,
        free=exc.free,
    )
