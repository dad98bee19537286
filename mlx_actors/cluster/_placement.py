"""Placement: which replica each agent of a cluster lives on, the agents being placed or
moved, and the choice of a replica for a new agent (beside agents whose long system
prompt begins alike, else the least busy)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping

from ..errors import InvalidRequestError, ReplicaLostError, UnknownAgentError

#: System prompts at least this long that begin alike (this many characters) put their
#: agents on one replica, so that the prefix is prefilled and held once.
SHARED_PREFIX_CHARS = 512


class Placement:
    """Where a cluster's agents live, as the cluster counts them (names ignore case)."""

    def __init__(self) -> None:
        #: Each agent's replica, and its system prompt.
        self.where: dict[str, int] = {}
        self.systems: dict[str, str | None] = {}
        #: Names of agents being spawned, and where they are going once placed (with
        #: their system prompt): placement counts them before the replica does.
        self._claimed: set[str] = set()
        self._placing: dict[str, tuple[int, str | None]] = {}
        #: Agents being moved: calls to them wait for the move (it holds the lock).
        self.moving: set[str] = set()

    def put(self, name: str, index: int, system: str | None) -> None:
        self.where[name], self.systems[name] = index, system

    def drop(self, name: str) -> None:
        """``name`` no longer lives anywhere."""
        self.where.pop(name, None)
        self.systems.pop(name, None)

    def clear(self) -> None:
        self.where.clear()
        self.systems.clear()

    def on(self, index: int) -> dict[str, str | None]:
        """The agents living on replica ``index``, with their system prompts."""
        return {n: self.systems.get(n) for n, where in self.where.items() if where == index}

    def taken(self, name: str) -> bool:
        folded = name.casefold()
        return any(n.casefold() == folded for n in (*self.where, *self._claimed))

    def replica_of(self, name: str) -> int:
        """The index of the replica agent ``name`` lives on."""
        try:
            return self.where[name]
        except KeyError:
            raise UnknownAgentError(f"no agent of the cluster is called {name!r}") from None

    @contextlib.contextmanager
    def claim(self, name: str) -> Iterator[None]:
        """Hold ``name`` while its agent is placed and made."""
        if not isinstance(name, str):
            raise InvalidRequestError(f"an agent's name is a str, got {name!r}")
        if self.taken(name):
            raise InvalidRequestError(f"the cluster already has an agent called {name!r}")
        self._claimed.add(name)
        try:
            yield
        finally:
            self._placing.pop(name, None)
            self._claimed.discard(name)

    def placing(self, name: str, index: int, system: str | None) -> None:
        """Claimed ``name`` goes to replica ``index``: count it there from now on."""
        self._placing[name] = (index, system)

    def candidates(self, system: str | None, alive: list[int]) -> list[int]:
        """The ``alive`` replicas a new agent with ``system`` may go to: those holding
        (or being given) agents whose system prompt begins alike, if any, else all."""
        if not alive:
            raise ReplicaLostError("no replica of the cluster is alive")
        key = _prefix(system)
        if key is not None:
            homes = [(self.where.get(n), s) for n, s in self.systems.items()]
            homes += list(self._placing.values())
            beside = {i for i, s in homes if i is not None and _prefix(s) == key} & set(alive)
            if beside:
                return sorted(beside)
        return alive

    def least_busy(self, loads: Mapping[int, tuple[int, int, int]]) -> int:
        """Fewest turns in flight, then fewest blocks resident, then fewest agents (as
        the cluster counts them, with those being placed there: concurrent spawns see
        each other even when a replica's own figures are a moment old)."""
        agents = collections.Counter(self.where.values())
        agents.update(i for i, _ in self._placing.values())
        busy = {i: (load[1], load[0], agents[i]) for i, load in loads.items()}
        return min(busy, key=busy.__getitem__)


def _prefix(system: str | None) -> str | None:
    if system is None or len(system) < SHARED_PREFIX_CHARS:
        return None
    return system[:SHARED_PREFIX_CHARS]
