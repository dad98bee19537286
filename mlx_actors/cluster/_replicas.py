"""The replicas of a cluster: their Ray actors and state directories, the calls to them,
and recovery: a replica found dead has its agents adopted, from its state directory, by
the live ones (their last saved turn)."""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from ..errors import InvalidRequestError, ReplicaLostError, RuntimeClosedError
from ..runtime._state import StateDir
from ..runtime._trace import ModuleLog
from ._placement import Placement
from ._replica import Replica

log = ModuleLog()


class Replicas:
    """``count`` runtimes, each a Ray actor (:class:`Replica`) with its state directory
    ``root/replica-N``; which of them live, and where their agents are (``placement``)."""

    def __init__(
        self,
        *,
        count: int,
        root: Path | None,
        address: str | None,
        options: Mapping[str, Any],
        placement: Placement,
    ) -> None:
        self.count = count
        self._root = root
        self._address = address
        self._options = options
        self._placement = placement
        self.ray: Any = None
        self.handles: list[Any] = []
        self.alive: list[bool] = []
        self.started: list[bool] = []
        #: Held by a move and by a recovery: one at a time.
        self.lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(1024)
        self._owns_ray = False
        self._temporary: tempfile.TemporaryDirectory[str] | None = None

    # -- life cycle -------------------------------------------------------------------------

    async def connect(self) -> None:
        """Join Ray (starting a local instance if none runs)."""
        try:
            import ray
        except ImportError:
            raise InvalidRequestError("Cluster needs Ray: pip install 'mlx-actors[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            await anyio.to_thread.run_sync(self._init_ray)
            self._owns_ray = True

    def launch(self, model: str | None, runtime_options: Mapping[str, Any]) -> None:
        """Create the replicas' Ray actors (each starts its runtime when asked to)."""
        if self._root is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="mlx-actors-cluster-")
            self._root = Path(self._temporary.name)
        actor = self.ray.remote(Replica)
        self.handles = [
            actor.options(max_concurrency=1024, **self._options).remote(
                i, model, str(self.dir(i)), dict(runtime_options)
            )
            for i in range(self.count)
        ]
        self.alive = [True] * self.count
        self.started = [False] * self.count

    def check_resources(self) -> None:
        """Refuse replicas the Ray cluster could never place (they would wait forever)."""
        options = self._options
        wanted = {
            "CPU": options.get("num_cpus", 0),
            "GPU": options.get("num_gpus", 0),
            **options.get("resources", {}),
        }
        have = self.ray.cluster_resources()
        for name, amount in wanted.items():
            if amount and have.get(name, 0) < amount * self.count:
                raise InvalidRequestError(
                    f"{self.count} replicas of {amount} {name} each need "
                    f"{amount * self.count}, and the Ray cluster has {have.get(name, 0)}; "
                    "change replica_options or replicas, or add nodes (ray start)"
                )

    def _init_ray(self) -> None:
        # Called on a worker thread (it blocks): Ray then warns that it set no SIGTERM
        # handler, which is as intended (the application's own handling stays).
        worker = logging.getLogger("ray._private.worker")
        worker.addFilter(_not_sigterm_notice)
        try:
            self.ray.init(
                address=self._address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        finally:
            worker.removeFilter(_not_sigterm_notice)

    async def shutdown(self) -> None:
        """Stop every replica (one still starting, or never scheduled, is killed), and Ray
        if it was started here."""
        try:
            for index, alive in enumerate(self.alive):
                if alive and self.started[index]:
                    try:
                        await self.raw(index, "stop")
                    except Exception as exc:  # a replica that cannot stop still goes
                        log.error("replica.stop_failed", replica=index, error=repr(exc))
        finally:
            for handle in self.handles:
                with contextlib.suppress(Exception):
                    self.ray.kill(handle)
            self.handles, self.alive, self.started = [], [], []
            self._placement.clear()
        if self._owns_ray:
            await anyio.to_thread.run_sync(self.ray.shutdown)
            self._owns_ray = False
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None

    def dir(self, index: int) -> Path:
        assert self._root is not None
        return self._root / f"replica-{index}"

    def check_open(self) -> None:
        if not self.handles:
            raise RuntimeClosedError("the cluster is not running (use async with Cluster(...))")

    def live(self) -> list[int]:
        return [i for i, ok in enumerate(self.alive) if ok]

    # -- calls ------------------------------------------------------------------------------

    async def call(self, index: int, method: str, *args: Any) -> Any:
        """Call a replica; if it died, bring its agents back elsewhere, then raise
        :class:`ReplicaLostError`."""
        self.check_open()
        if not self.alive[index]:
            raise ReplicaLostError(f"replica {index} is gone")
        try:
            return await self.raw(index, method, *args)
        except self.dead:
            raise await self._lost(index, f"{method}()") from None

    async def _lost(self, index: int, during: str) -> ReplicaLostError:
        """Replica ``index`` was found gone during a call: recover it; the error to raise."""
        await self._recover(index)
        return ReplicaLostError(
            f"replica {index} died during {during}; its agents were brought back on the "
            "other replicas from their last saved state: make the request again"
        )

    @property
    def dead(self) -> tuple[type[BaseException], ...]:
        """What a call to a replica raises when the replica is gone: its process died, or
        its runtime stopped while the process lives on."""
        return (self.ray.exceptions.RayActorError, ReplicaLostError)

    async def raw(self, index: int, method: str, *args: Any) -> Any:
        """Call a replica, as it answers (errors raised there as they were)."""
        ref = getattr(self.handles[index], method).remote(*args)
        try:
            return await anyio.to_thread.run_sync(
                self.ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
            )
        except anyio.get_cancelled_exc_class():
            self.ray.cancel(ref)  # the turn is undone there, as on any cancel
            raise
        except self.ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    async def get(self, index: int, fetch: Any) -> Any:
        """``fetch()`` on a worker thread (it waits on Ray), with :meth:`call`'s
        handling of a replica that died and of errors raised there."""
        try:
            try:
                return await anyio.to_thread.run_sync(
                    fetch, abandon_on_cancel=True, limiter=self._limiter
                )
            except self.ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None  # a replica whose runtime stopped: below
        except self.dead:
            raise await self._lost(index, "a stream") from None

    # -- recovery ---------------------------------------------------------------------------

    async def _recover(self, index: int) -> None:
        """Replica ``index`` died: adopt its agents, from its state directory, on the
        others (their last saved turn; what a caller had received was saved first).
        Shielded: a caller's cancel or timeout waits for the agents to be placed."""
        self.check_open()
        with anyio.CancelScope(shield=True):
            async with self.lock:
                queue: list[int] = []
                self.mark_dead(index, queue)
                await self.evacuate(queue)

    def mark_dead(self, index: int, queue: list[int]) -> None:
        if self.alive[index]:
            self.alive[index] = False
            with contextlib.suppress(Exception):
                self.ray.kill(self.handles[index])
            queue.append(index)

    async def evacuate(self, queue: list[int]) -> None:
        """Under the lock: adopt the agents of each dead replica in ``queue`` on the
        live ones (a replica found dead meanwhile joins the queue)."""
        while queue:
            index = queue.pop(0)
            lost = self._placement.on(index)
            log.error("replica.lost", replica=index, agents=len(lost))
            await self.adopt_all(self.dir(index), lost, queue)

    async def adopt_all(
        self, source: Path, agents: Mapping[str, str | None], queue: list[int]
    ) -> None:
        """Under the lock: adopt ``agents`` from the state directory ``source`` on live
        replicas, then delete them there (one home only). An agent that cannot be
        adopted is lost (logged, and no longer known)."""
        for name, system in agents.items():
            target = None
            while target is None and any(self.alive):
                try:
                    target = await self._place_now(system, queue)
                    await self.raw(target, "adopt", str(source), name)
                except self.dead:
                    if target is not None:
                        self.mark_dead(target, queue)
                    target = None
                except Exception as exc:
                    log.error("agent.lost", agent=name, error=repr(exc))
                    break
            if target is None:
                if not any(self.alive):
                    log.error("agent.lost", agent=name, error="no replica is alive")
                self._placement.drop(name)
                continue
            self._placement.put(name, target, system)
            await forget_in(source, name)  # one home only
            log.info("agent.recovered", agent=name, replica=target)

    async def _place_now(self, system: str | None, queue: list[int]) -> int:
        """Placement for a recovery: replicas that do not answer join ``queue``."""
        while True:
            candidates = self._placement.candidates(system, self.live())
            loads = {}
            for i in candidates:
                try:
                    loads[i] = await self.raw(i, "load")
                except self.dead:
                    self.mark_dead(i, queue)
                except Exception as exc:  # a replica that cannot say is not chosen
                    log.error("replica.load_failed", replica=i, error=repr(exc))
            if not loads and any(self.alive[i] for i in candidates):
                # Not a ReplicaLostError: the replicas live, the agent cannot be placed.
                raise RuntimeError("no live replica answered")
            if loads:
                return self._placement.least_busy(loads)

    async def adopt_leftovers(self) -> None:
        """Agents of a state directory written by a cluster of more replicas than this
        one come back on this one's."""
        assert self._root is not None
        extra = sorted(
            int(m[1])
            for p in self._root.glob("replica-*")
            if (m := re.fullmatch(r"replica-(\d+)", p.name)) and int(m[1]) >= self.count
        )
        for index in extra:
            where = self.dir(index)
            try:
                records = await anyio.to_thread.run_sync(StateDir(where, persist="turn").records)
            except OSError:
                continue
            agents = {r.name: r.system for r in records if not self._placement.taken(r.name)}
            if agents:
                log.info("replica.leftover", directory=str(where), agents=len(agents))
                async with self.lock:
                    queue: list[int] = []
                    await self.adopt_all(where, agents, queue)
                    await self.evacuate(queue)


async def forget_in(directory: Path, name: str) -> None:
    """Delete agent ``name``'s record and cache from a state directory no live runtime
    uses (a dead replica's, or one left by a larger cluster); failures are logged."""
    state = StateDir(directory, persist="turn")
    try:
        await state.delete(name)
        await state.caches().drop(name)
    except Exception as exc:
        log.error("agent.forget_failed", agent=name, directory=str(directory), error=repr(exc))


def _cause(error: Any) -> BaseException:
    """The error raised in a replica, as it was (Ray wraps it)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _not_sigterm_notice(record: logging.LogRecord) -> bool:
    return "SIGTERM handler is not set" not in record.getMessage()
