"""The scheduler actor: owns the engine on one thread and serves turns to async callers."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import structlog

from ..errors import EngineError, MlxActorsError, RuntimeClosedError
from ._blocks import max_trim
from ._engine import (
    BlockPoolBatchEngine,
    CompletedGeneration,
    EngineStatistics,
    Sampling,
    TokenEvent,
)
from ._pool import AgentBlocks, BlockPool, PoolStatistics
from ._spec import ModelCacheSpec

Loader = Callable[[], tuple[Any, Any]]


@attrs.define(eq=False)
class Turn:
    """One agent's request: new tokens against its cache, and where the answer goes.

    Made on the event loop; the engine thread fills ``uid`` and the scheduler sets the
    outcome (``result`` or ``error``) before ``done`` is set.
    """

    agent: str
    prompt: list[int]
    cache: AgentBlocks | None
    trim: int
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    #: Called on the event loop with each printable piece of text.
    on_text: Callable[[str], None] | None = None
    id: int = attrs.field(factory=itertools.count(1).__next__)
    result: CompletedGeneration | None = None
    error: BaseException | None = None
    done: anyio.Event = attrs.field(factory=anyio.Event)
    #: Set once a cancellation has reached the engine (or found nothing to cancel).
    cancelled: anyio.Event = attrs.field(factory=anyio.Event)
    uid: int | None = None
    queued_at: float = attrs.field(factory=time.perf_counter)


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """Where the scheduler stands."""

    pool: PoolStatistics
    engine: EngineStatistics
    #: Turns queued or running now.
    turns_in_flight: int


@attrs.frozen
class _Submit:
    turn: Turn


@attrs.frozen
class _Cancel:
    turn: Turn


@attrs.frozen
class _Release:
    blocks: AgentBlocks


@attrs.frozen
class _Query:
    reply: Callable[[SchedulerStatistics], None]


_SHUTDOWN = object()


class Scheduler:
    """Batches every agent's turns through one :class:`BlockPoolBatchEngine`.

    All MLX work (loading the model, every step, cutting caches into blocks, freeing
    them) happens on one engine thread; the event loop only exchanges messages with
    it: commands go in through a thread-safe queue, and after each step the thread
    hands the loop one ordered batch of deliveries (text pieces, finished and failed
    turns). New turns join the batch at step boundaries.

    Run :meth:`serve` in a task group, then await :meth:`wait_started`; call
    :meth:`shutdown` before leaving the task group.

    ``admission_window`` (seconds): when the engine is idle and a turn arrives, it waits
    until no other turn has arrived for this long (at most ten times as long) before the
    first step, so that turns sent at the same moment start in one batch. It delays a
    lone turn by that much; 0 turns it off.
    """

    def __init__(
        self,
        load: Loader,
        *,
        pool_blocks: int | None = None,
        pool_bytes: int | None = None,
        max_batch_size: int = 32,
        prefill_step_size: int = 512,
        admission_window: float = 0.002,
        log: Any = None,
    ) -> None:
        self._load = load
        self._admission_window = admission_window
        self._pool_blocks, self._pool_bytes = pool_blocks, pool_bytes
        self._max_batch_size = max_batch_size
        self._prefill_step_size = prefill_step_size
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._started = anyio.Event()
        self._startup_error: BaseException | None = None
        self._final: SchedulerStatistics | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.spec: ModelCacheSpec | None = None

    # -- life cycle ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the engine thread until :meth:`shutdown`. Start-up errors are kept for
        :meth:`wait_started` rather than raised here."""
        try:
            await anyio.to_thread.run_sync(self._thread_main)
        except BaseException as exc:
            if self._started.is_set():
                raise
            self._startup_error = exc
            self._started.set()

    async def wait_started(self) -> None:
        """Wait until the model is loaded and the engine ready; raise what stopped it."""
        await self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def shutdown(self) -> None:
        """Ask the engine thread to stop; every turn still in flight fails with
        :class:`RuntimeClosedError`. Safe to call more than once."""
        self._put(_SHUTDOWN)

    # -- the async side ------------------------------------------------------------------

    async def run_turn(self, turn: Turn) -> CompletedGeneration:
        """Queue ``turn`` and wait for its result.

        If the caller is cancelled, the turn is removed from the batch and its blocks
        freed before this returns; the ``cache`` it was given is untouched.
        """
        self._log.debug(
            "turn.queued", agent=turn.agent, turn=turn.id, prompt_tokens=len(turn.prompt)
        )
        self._put(_Submit(turn))
        try:
            await turn.done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                if not turn.done.is_set():
                    self._put(_Cancel(turn))
                    await turn.cancelled.wait()
                if turn.result is not None:  # it finished before the cancel landed
                    self.release(turn.result.blocks)
                    turn.result = None
            raise
        if turn.error is not None:
            raise turn.error
        assert turn.result is not None
        return turn.result

    def release(self, blocks: AgentBlocks | None) -> None:
        """Give blocks back to the pool (on the engine thread, in order)."""
        if blocks is not None:
            self._put(_Release(blocks))

    async def statistics(self) -> SchedulerStatistics:
        """A consistent snapshot, taken on the engine thread after every earlier command."""
        if self._final is not None:
            return self._final
        answer: list[SchedulerStatistics] = []
        ready = anyio.Event()

        def reply(stats: SchedulerStatistics) -> None:
            answer.append(stats)
            ready.set()

        self._put(_Query(reply))
        await ready.wait()
        return answer[0]

    def _put(self, command: object) -> None:
        with self._lock:
            if not self._stopped:
                self._commands.put(command)
                return
        self._refuse(command)

    def _refuse(self, command: object) -> None:
        """Answer a command the stopped engine thread will never see."""
        if isinstance(command, _Submit):
            self._fail(command.turn, RuntimeClosedError("the runtime has shut down"))
        elif isinstance(command, _Cancel):
            command.turn.cancelled.set()
        elif isinstance(command, _Query) and self._final is not None:
            command.reply(self._final)

    def _fail(self, turn: Turn, error: BaseException) -> None:
        if not turn.done.is_set():
            turn.error = error
            turn.done.set()
        turn.cancelled.set()

    def _deliver(self, items: list[tuple[str, Any, Any]]) -> None:
        """Runs on the event loop: hand one step's results to their turns, in order."""
        for kind, target, value in items:
            if kind == "text":
                if target.on_text is not None and not target.done.is_set():
                    target.on_text(value)
            elif kind == "done":
                target.result = value
                target.done.set()
            elif kind == "failed":
                self._fail(target, value)
            elif kind == "cancelled":
                target.cancelled.set()
            elif kind == "stats":
                target(value)  # a _Query's reply callback

    # -- the engine thread ---------------------------------------------------------------

    def _start_engine(self) -> BlockPoolBatchEngine:
        model, tokenizer = self._load()
        spec = ModelCacheSpec.from_model(model)
        if self._pool_blocks is not None:
            pool = BlockPool(spec, total_blocks=self._pool_blocks)
        else:
            pool = BlockPool.from_bytes(spec, self._pool_bytes or 1 << 30)
        engine = BlockPoolBatchEngine(
            model,
            tokenizer,
            pool,
            max_batch_size=self._max_batch_size,
            prefill_step_size=self._prefill_step_size,
        )
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self._log.info(
            "scheduler.started",
            layers=spec.num_layers,
            sliding_layers=spec.sliding_layers,
            block_bytes=spec.block_bytes,
            pool_blocks=pool.total_blocks,
            max_batch_size=self._max_batch_size,
        )
        return engine

    def _thread_main(self) -> None:
        try:
            engine = self._start_engine()
        except BaseException:
            with self._lock:
                self._stopped = True
            raise
        anyio.from_thread.run_sync(self._started.set)
        turns: dict[int, Turn] = {}
        outbox: list[tuple[str, Any, Any]] = []
        try:
            self._serve(engine, turns, outbox)
        finally:
            with self._lock:
                self._stopped = True
            leftovers = []
            while True:
                try:
                    leftovers.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in leftovers:
                if isinstance(command, _Release):
                    engine.release(command.blocks)
            closed = RuntimeClosedError("the runtime shut down before the turn finished")
            for turn in turns.values():
                outbox.append(("failed", turn, closed))
            engine.close()
            self._final = self._snapshot(engine, 0)
            for command in leftovers:
                if isinstance(command, _Submit):
                    outbox.append(("failed", command.turn, closed))
                elif isinstance(command, _Cancel):
                    outbox.append(("cancelled", command.turn, None))
                elif isinstance(command, _Query):
                    outbox.append(("stats", command.reply, self._final))
            anyio.from_thread.run_sync(self._deliver, outbox)
            self._log.info("scheduler.stopped", pool_used=self._final.pool.used_blocks)

    def _serve(
        self,
        engine: BlockPoolBatchEngine,
        turns: dict[int, Turn],
        outbox: list[tuple[str, Any, Any]],
    ) -> None:
        while True:
            # Idle: block until there is work. Busy: take what arrived since the step.
            idle = not engine.active
            try:
                command = self._commands.get(block=idle)
            except queue.Empty:
                command = None
            if idle and self._admission_window > 0:
                # Turns sent together (a fan-out) trickle in over a few milliseconds;
                # gathering them before the first step prefills them as one batch.
                cap = time.perf_counter() + 10 * self._admission_window
                while command is not None:
                    if command is _SHUTDOWN:
                        return
                    self._apply(engine, turns, outbox, command)
                    wait = min(self._admission_window, cap - time.perf_counter())
                    try:
                        command = self._commands.get(timeout=wait) if wait > 0 else None
                    except queue.Empty:
                        command = None
            while command is not None:
                if command is _SHUTDOWN:
                    return
                self._apply(engine, turns, outbox, command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.active:
                self._step(engine, turns, outbox)
            if outbox:
                anyio.from_thread.run_sync(self._deliver, outbox[:])
                outbox.clear()

    def _apply(
        self,
        engine: BlockPoolBatchEngine,
        turns: dict[int, Turn],
        outbox: list[tuple[str, Any, Any]],
        command: object,
    ) -> None:
        if isinstance(command, _Submit):
            self._admit(engine, turns, outbox, command.turn)
        elif isinstance(command, _Cancel):
            turn = command.turn
            if turn.uid is not None and turns.pop(turn.uid, None) is not None:
                engine.cancel(turn.uid)
                self._log.info(
                    "turn.cancelled",
                    agent=turn.agent,
                    turn=turn.id,
                    pool_used=engine.pool.used_blocks,
                )
            outbox.append(("cancelled", turn, None))
        elif isinstance(command, _Release):
            engine.release(command.blocks)
        elif isinstance(command, _Query):
            outbox.append(("stats", command.reply, self._snapshot(engine, len(turns))))

    def _admit(
        self,
        engine: BlockPoolBatchEngine,
        turns: dict[int, Turn],
        outbox: list[tuple[str, Any, Any]],
        turn: Turn,
    ) -> None:
        prompt, cache, trim = turn.prompt, turn.cache, turn.trim
        if cache is not None and trim > max_trim(engine.spec, cache):
            # Sliding-window layers no longer hold what the rewind needs: prefill it all.
            prompt = [*cache.tokens[: cache.num_tokens - trim], *prompt]
            cache, trim = None, 0
        on_token = None
        if turn.on_text is not None:

            def on_token(event: TokenEvent, turn: Turn = turn) -> None:
                if event.text:
                    outbox.append(("text", turn, event.text))

        try:
            uid = engine.submit(
                turn.agent,
                prompt,
                cache,
                trim=trim,
                max_tokens=turn.max_tokens,
                sampling=turn.sampling,
                stop=turn.stop,
                on_token=on_token,
            )
        except MlxActorsError as exc:
            self._log.info("turn.refused", agent=turn.agent, turn=turn.id, error=type(exc).__name__)
            outbox.append(("failed", turn, exc))
            return
        except Exception as exc:
            error = EngineError(f"the engine could not take the turn: {exc!r}")
            outbox.append(("failed", turn, error))
            return
        turn.uid = uid
        turns[uid] = turn
        self._log.info(
            "turn.admitted",
            agent=turn.agent,
            turn=turn.id,
            batch=engine.active,
            prefill_tokens=len(prompt),
            cached_tokens=(cache.num_tokens - trim) if cache is not None else 0,
            queued_ms=round((time.perf_counter() - turn.queued_at) * 1e3, 2),
            pool_used=engine.pool.used_blocks,
            pool_free=engine.pool.free_blocks,
        )

    def _step(
        self,
        engine: BlockPoolBatchEngine,
        turns: dict[int, Turn],
        outbox: list[tuple[str, Any, Any]],
    ) -> None:
        try:
            finished = engine.step()
        except EngineError as exc:
            self._log.error("batch.failed", error=str(exc), turns=len(exc.uids))
            for uid in exc.uids:
                outbox.append(("failed", turns.pop(uid), exc))
            return
        info = engine.last_step
        if info is not None:
            self._log.debug(
                "batch.step",
                batch=info.decode_batch,
                prefill_tokens=info.prefill_tokens,
                finished=info.finished,
                ms=round(info.seconds * 1e3, 3),
                pool_used=engine.pool.used_blocks,
            )
        for result in finished:
            turn = turns.pop(result.uid)
            usage = result.usage
            self._log.info(
                "turn.finished",
                agent=turn.agent,
                turn=turn.id,
                finish=result.finish_reason,
                prefill_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                generated_tokens=usage.generated_tokens,
                ttft_ms=round(result.ttft_s * 1e3, 1),
                total_ms=round(result.total_s * 1e3, 1),
                pool_used=engine.pool.used_blocks,
            )
            outbox.append(("done", turn, result))

    def _snapshot(self, engine: BlockPoolBatchEngine, in_flight: int) -> SchedulerStatistics:
        return SchedulerStatistics(
            pool=engine.pool.statistics(),
            engine=engine.statistics(),
            turns_in_flight=in_flight,
        )
