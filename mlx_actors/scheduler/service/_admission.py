"""Which turn is admitted when: a turn's cache brought back (from host memory, or read
from disk first), its submission to the engine within the pool's room, the line of
turns waiting for room, and the caches brought back ahead of their turns. Engine thread
only; the :class:`~._loop.EngineLoop` hands it the turns and the pool's news."""

from __future__ import annotations

import collections
import time
from typing import Any

from ...errors import CacheReconstructionError, EngineError, MlxActorsError, PoolExhaustedError
from ..engine._constraint import Constraint, grammar_tokenizer
from ..engine._engine import BlockPoolBatchEngine
from ..engine._records import TokenEvent
from ..residency._entry import CacheEntry
from ..residency._image import CacheImage
from ..residency._manager import CacheManager, nothing_to_evict
from ..residency._prefetch import Prefetcher
from . import _events as events
from ._protocol import Turn


class Admission:
    """Admits turns in order of arrival; a turn the pool has no room for while other
    turns are in flight waits (:attr:`waiting`) until one of them finishes and frees (or
    makes evictable) what it held. ``turns``: the turns in the engine, by uid (the
    loop's; admitted turns are added)."""

    def __init__(
        self,
        engine: BlockPoolBatchEngine,
        caches: CacheManager,
        outbox: list[events.Event],
        turns: dict[int, Turn],
        *,
        log: Any,
    ) -> None:
        self.engine = engine
        self.caches = caches
        self.pool = engine.pool
        self.outbox = outbox
        self.turns = turns
        self._log = log
        #: Turns waiting for room in the pool, oldest first (with the cache read back
        #: from disk for them, if any).
        self.waiting: collections.deque[tuple[Turn, CacheImage | None]] = collections.deque()
        #: Whether blocks may have been freed since the waiting turns last tried.
        self.room = False
        #: The tokenizer as the grammar engine reads it (built at the first constraint).
        self._grammar_tokenizer: Any = None
        #: Brings back the cache of the agent expected next while turns run.
        self.prefetcher = Prefetcher(caches, log=log)

    def cancel_waiting(self, turn: Turn) -> bool:
        """Take ``turn`` out of the waiting line; whether it was there."""
        if not any(waiting is turn for waiting, _ in self.waiting):
            return False
        self.waiting = collections.deque(w for w in self.waiting if w[0] is not turn)
        return True

    def admit(self, turn: Turn, image: CacheImage | None) -> None:
        if self.waiting:  # in order of arrival
            self.wait_for_room(turn, image, None)
        elif (short := self._try_admit(turn, image)) is not None:
            self.wait_for_room(turn, image, short)

    def admit_waiting(self) -> None:
        """Admit the waiting turns, oldest first, while they fit."""
        self.room = False
        while self.waiting:
            turn, image = self.waiting[0]
            if self._try_admit(turn, image) is not None:
                break
            self.waiting.popleft()

    def wait_for_room(
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
                image = image or self.prefetcher.image(turn.agent)
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
        self.prefetcher.due = True  # which agent is expected next changed
        turn.uid = uid
        self.turns[uid] = turn
        return None

    def prefetch(self) -> None:
        """Bring back the cache of the agent expected next, or ask for it to be read."""
        restored, read = self.prefetcher.run()
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
