"""The scheduler actor: owns the engine thread and serves turns to async callers."""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import mlx.core as mx
import structlog
from anyio.lowlevel import EventLoopToken

from ...errors import EngineError, MlxActorsError, RuntimeClosedError
from ..caches._quantized import KVQuantization
from ..engine._records import CompletedGeneration
from ..kv._pool import AgentBlocks
from ..kv._spec import ModelCacheSpec
from ..residency._image import CacheImage
from ._build import EngineOptions, build_loop, max_text_chars
from ._coming import Coming, Expected
from ._deliveries import Deliveries
from ._disk import DiskWork
from ._loop import EngineLoop, Outbox
from ._protocol import (
    SHUTDOWN,
    Adopt,
    CacheStore,
    Cancel,
    Commit,
    Fork,
    Pin,
    Query,
    Release,
    Save,
    SchedulerStatistics,
    Submit,
    Turn,
    Undo,
)

Loader = Callable[[], tuple[Any, Any]]


class Scheduler:
    """Batches every agent's turns through one :class:`BlockPoolBatchEngine`.

    All MLX work (loading the model, every step, cutting caches into blocks, moving
    them to host memory and back) happens on one engine thread (:class:`EngineLoop`).
    The event loop only exchanges messages with it: commands go in through a
    thread-safe queue, and after each step the thread hands the loop one ordered batch
    of deliveries. Caches the pool must give up go to ``store``, written and read on
    worker threads, one agent's operations in order.

    Run :meth:`serve` in a task group, then await :meth:`wait_started`; call
    :meth:`shutdown` before leaving the task group.

    ``admission_window`` (seconds): when the engine is idle and a turn arrives while
    other turns are on their way (asked, and not yet rendered: :meth:`announce`), it
    waits for them, as long as each comes within this long (at most ten times as long
    in all), so that turns asked together start in one batch. A lone turn starts at
    once; 0 turns the wait off. ``compile_kernels``: compile the custom CUDA kernels the
    caches may launch at start; ``eviction``: how an idle cache is chosen to leave the
    pool (see :class:`~mlx_actors.Runtime`).
    """

    def __init__(
        self,
        load: Loader,
        store: CacheStore,
        *,
        pool_blocks: int | None = None,
        pool_bytes: int | None = None,
        max_batch_size: int = 32,
        prefill_step_size: int = 512,
        admission_window: float = 0.002,
        share_prefixes: bool = True,
        host_bytes: int | None = None,
        kv_quantization: KVQuantization | None = None,
        paged_batch: bool = False,
        decode_kernel: bool = True,
        compile_kernels: bool = False,
        eviction: str = "next-use",
        log: Any = None,
    ) -> None:
        self._load = load
        self._options = EngineOptions(
            pool_blocks=pool_blocks,
            pool_bytes=pool_bytes,
            max_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            admission_window=admission_window,
            share_prefixes=share_prefixes,
            host_bytes=host_bytes,
            kv_quantization=kv_quantization,
            paged_batch=paged_batch,
            decode_kernel=decode_kernel,
            compile_kernels=compile_kernels,
            eviction=eviction,
        )
        self._log = log if log is not None else structlog.get_logger(__name__)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._started = anyio.Event()
        self._startup_error: BaseException | None = None
        self._token: EventLoopToken | None = None
        self._disk = DiskWork(store, self._put, log=self._log)
        self._deliveries = Deliveries(self._disk, log=self._log)
        #: Turns on their way (read by the engine thread; changed only on the event loop).
        self._coming = Coming()
        self.model: Any = None
        self.tokenizer: Any = None
        self.spec: ModelCacheSpec | None = None
        #: Held while the tokenizer runs (on worker threads): it is not thread-safe.
        self.tokenizer_lock = threading.Lock()
        #: A text longer than this many characters cannot fit one turn, whatever it
        #: tokenises to (set when the engine starts).
        self.max_text_chars: int | None = None

    # -- life cycle ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the engine thread until :meth:`shutdown`, and the disk work it asks for.
        Start-up errors are kept for :meth:`wait_started` rather than raised here."""
        self._token = anyio.lowlevel.current_token()
        finished = anyio.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self._thread_main()
            except BaseException as exc:
                failure.append(exc)
            finally:
                try:
                    # MLX keeps per-thread streams and compiled graphs; left to the
                    # thread's exit they can be destroyed after the interpreter has
                    # finalised, which aborts the process (ml-explore/mlx#4327, #4373).
                    mx.clear_streams()
                finally:
                    anyio.from_thread.run_sync(finished.set, token=self._token)

        # A thread of our own rather than a pooled worker: it must end, streams
        # cleared, with the runtime, and no later MLX work may land on it.
        thread = threading.Thread(target=main, name="mlx-actors-engine")
        # Shielded: the thread and the disk work it asks for (saves that callers wait
        # on, shielded, while the runtime closes) stop only on shutdown, not on a cancel.
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as background:
                self._disk.start(background)
                thread.start()
                await finished.wait()
                await anyio.to_thread.run_sync(thread.join)
            if failure:
                if self._started.is_set():
                    raise failure[0]
                self._startup_error = failure[0]
                self._started.set()

    async def wait_started(self) -> None:
        """Wait until the model is loaded and the engine ready; raise what stopped it.

        A typed error (a model not found, a corrupt file...) says what to do in its
        message: it is raised without the engine thread's frames, and what caused it is
        kept as its ``__context__`` but not printed."""
        await self._started.wait()
        error = self._startup_error
        if error is None:
            return
        if isinstance(error, MlxActorsError):
            self._log.debug(  # the whole story, for a bug report: not in the user's face
                "runtime.start_failed",
                error=repr(error),
                traceback="".join(traceback.format_exception(error)),
            )
            cause, error.__cause__ = error.__cause__, None
            error.__context__ = cause or error.__context__
            error.__suppress_context__ = True
            raise error.with_traceback(None)
        raise error

    @property
    def share_prefixes(self) -> bool:
        """Whether agents share what they hold in common (``share_prefixes=``)."""
        return self._options.share_prefixes

    @property
    def token(self) -> EventLoopToken | None:
        """The event loop the scheduler serves (``None`` before :meth:`serve`)."""
        return self._token

    def shutdown(self) -> None:
        """Ask the engine thread to stop; every turn still in flight fails with
        :class:`RuntimeClosedError`. Safe to call more than once."""
        self._put(SHUTDOWN)

    # -- the async side ------------------------------------------------------------------

    def announce(self, turns: int) -> None:
        """Say that ``turns`` more turns are on their way (negative: that they came, or
        will not): an idle engine that receives a turn waits a moment for those."""
        self._coming.announce(turns)

    def asked(self) -> None:
        """A turn was asked: on its way (see :meth:`Coming.asked`)."""
        self._coming.asked()

    def expect(self) -> Expected:
        """A turn not asked yet is on its way (see :meth:`Coming.expect`)."""
        return self._coming.expect()

    async def run_turn(
        self, turn: Turn, *, sent: Callable[[], None] | None = None
    ) -> CompletedGeneration:
        """Queue ``turn`` and wait for its result; the caller must :meth:`commit` or
        :meth:`release` the result's blocks. ``sent`` is called once the turn is queued
        (an announced turn: :meth:`announce`).

        If the agent's cache is out of the pool and not in host memory, the engine
        thread asks for it and it is read back from the store (on a worker thread). If
        the caller is cancelled, the turn is removed from the batch and its blocks freed
        before this returns.
        """
        self._log.debug("turn.queued", agent=turn.agent, turn=turn.id, tokens=len(turn.tokens))
        image: CacheImage | None = None
        while True:
            self._put(Submit(turn, image))
            if sent is not None:
                sent()
                sent = None
            try:
                await turn.settled.wait()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    if not turn.settled.is_set():
                        self._put(Cancel(turn))
                        await turn.cancelled.wait()
                    if turn.result is not None:  # it finished before the cancel landed
                        self.release(turn.agent, turn.result.blocks)
                        turn.result = None
                raise
            if not turn.needs_restore:
                break
            turn.needs_restore, turn.settled = False, anyio.Event()
            image = await self._disk.read(turn.agent)  # None: gone, start over
        if turn.error is not None:
            raise turn.error
        assert turn.result is not None
        return turn.result

    def commit(
        self,
        agent: str,
        blocks: AgentBlocks,
        *,
        hold: bool = False,
        saving: bool = False,
        snapshot: bool = False,
    ) -> None:
        """Make a finished turn's blocks the agent's cache (its old blocks are freed).

        With ``hold`` the turn goes on (a round of tool calls, or its save): the cache
        the turn started from is kept, and the agent is not evicted, until a commit
        without ``hold`` (which frees it) or :meth:`undo` (which restores it). With
        ``saving`` the turn still counts as in flight meanwhile (see
        :class:`~._protocol.Commit`). With ``snapshot`` the engine thread copies what
        the store lacks of the cache as it commits it, for the agent's next
        :meth:`save` (which then asks the engine thread nothing)."""
        number = self._deliveries.expect_snapshot(agent, snapshot)
        stored = self._disk.take_stored(agent)
        self._put(Commit(agent, blocks, hold, saving, number, stored))

    def undo(self, agent: str) -> None:
        """After commits with ``hold``: the agent's cache is again the one the turn
        started from; the rounds' blocks are freed."""
        self._deliveries.take_snapshot(agent)
        self._put(Undo(agent))

    def release(self, agent: str, blocks: AgentBlocks) -> None:
        """Drop a finished turn the agent does not take: free its blocks."""
        self._put(Release(agent, blocks))

    def adopt(self, agent: str, tokens: tuple[int, ...]) -> None:
        """Register an agent whose cache is in the store (brought back from disk)."""
        self._disk.adopted(agent)
        self._put(Adopt(agent, tokens))

    async def save(self, agent: str, *, wait: bool = True) -> None:
        """Write the agent's cache to the store (only blocks not written before); raise
        what stopped the write. Without ``wait``, a snapshot taken with the commit is
        written in the background (:meth:`DiskWork.write_behind`: the caller waits only
        for the agent's previous such write, and a failure is logged)."""
        taken = self._deliveries.take_snapshot(agent)
        if taken is not None and not wait:

            async def image() -> CacheImage | None:
                await taken.ready.wait()
                return taken.image

            await self._disk.write_behind(agent, image)
            return
        if taken is not None:  # taken with the commit: write it after earlier disk work
            await taken.ready.wait()
            if taken.image is not None:
                await self._disk.write(agent, taken.image)
            return
        done = anyio.Event()
        outcome: list[BaseException | None] = []

        def reply(error: BaseException | None) -> None:
            outcome.append(error)
            done.set()

        self._put(Save(agent, reply, self._disk.take_stored(agent)))
        await done.wait()
        if outcome[0] is not None:
            raise outcome[0]

    async def fork(self, parent: str, child: str) -> None:
        """Give ``child`` the parent's cache: its blocks by reference, or, if they are on
        disk, a copy of the parent's saved cache (read back on the child's first turn).

        Raises:
            RuntimeClosedError: the runtime shut down first.
        """
        done = anyio.Event()
        outcome: list[bool | None] = []

        def reply(on_disk: bool | None) -> None:
            outcome.append(on_disk)
            done.set()

        self._put(Fork(parent, child, reply))
        await done.wait()
        if outcome[0] is None:
            raise RuntimeClosedError("the runtime shut down before the fork")
        if outcome[0]:
            await self._disk.copy(parent, child)

    async def forget(self, agent: str, *, drop: bool) -> None:
        """Free the agent's cache; with ``drop``, delete it from the store as well."""
        self._deliveries.take_snapshot(agent)
        await self._disk.forget(agent, drop=drop)

    def pin(self, agent: str, seconds: float | None) -> None:
        """Keep the agent's cache in the pool for ``seconds`` (``None``: unpin); see
        :meth:`~mlx_actors.Agent.pin`."""
        self._put(Pin(agent, seconds))

    def on_disk(self, agent: str) -> bool:
        """Whether the agent's cache is in the store rather than in the pool."""
        return self._disk.out(agent)

    async def statistics(self) -> SchedulerStatistics:
        """A consistent snapshot, taken on the engine thread after every earlier command."""
        if self._deliveries.final is not None:
            return self._deliveries.final
        answer: list[SchedulerStatistics] = []
        ready = anyio.Event()

        def reply(stats: SchedulerStatistics) -> None:
            answer.append(stats)
            ready.set()

        self._put(Query(reply))
        await ready.wait()
        return answer[0]

    async def idle_disk(self) -> None:
        """Wait until every disk operation asked for so far is done."""
        await self._disk.idle()

    # -- commands --------------------------------------------------------------------------

    def _put(self, command: object) -> None:
        with self._lock:
            if not self._stopped:
                self._commands.put(command)
                return
        self._deliveries.refuse(command)

    # -- the engine thread ---------------------------------------------------------------

    def _start_engine(self) -> EngineLoop:
        model, tokenizer = self._load()
        loop = build_loop(
            model,
            tokenizer,
            self._options,
            persistent_store=self._disk.store.persistent,
            commands=self._commands,
            deliver=self._deliver_from_thread,
            coming=lambda: self._coming.count,
            log=self._log,
        )
        spec = loop.pool.spec
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.max_text_chars = max_text_chars(tokenizer, spec, loop.pool.total_blocks)
        return loop

    def _deliver_from_thread(self, items: Outbox) -> None:
        """Hand one step's events to the event loop and go on: the engine thread does
        not wait for the loop to run them (it would wait for whatever the loop is busy
        with, streaming the last step's text, say). They run in the order handed over,
        before anything the thread asks of the loop later."""
        assert self._token is not None
        # (anyio's own call, as its portals use it: with the library's context set)
        token = self._token
        token.backend_class.run_sync_soon(self._deliveries.deliver, (items,), token.native_token)

    def _thread_main(self) -> None:
        try:
            loop = self._start_engine()
        except BaseException:
            with self._lock:
                self._stopped = True
            raise
        failure: EngineError | None = None
        try:
            anyio.from_thread.run_sync(self._started.set, token=self._token)
            loop.run()
        except Exception as exc:
            # A bug of ours: the engine stops, and everything waiting on it is answered
            # with the error (no turn waits for an engine that is gone).
            failure = EngineError(f"the engine stopped on an unexpected error: {exc!r}")
            self._log.error(
                "scheduler.failed",
                error=repr(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
            raise failure from exc
        finally:
            with self._lock:
                self._stopped = True
                self._deliveries.failure = failure
            leftovers = [] if loop.applying is None else [loop.applying]
            while True:
                try:
                    leftovers.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                final = self._deliveries.final = loop.close(leftovers, failure)
            finally:
                self._deliver_from_thread(loop.outbox)
            self._log.info("scheduler.stopped", pool_used=final.pool.used_blocks)
