"""When each agent is likely to be asked next, from the order turns have started in: the
eviction priority of the cache manager (the agent expected furthest away leaves first).

Agent programs ask their agents in regular orders: a round-robin dialogue asks each of N
agents once every N turns, a main agent with helpers speaks after each helper. The least
recently used agent is then the one asked next, exactly the wrong cache to evict (KVFlow,
arXiv:2507.07400, orders by "steps to execution" instead). Here time is counted in turns
started, and each agent's next turn is expected one of its own periods after its last:
the gap between its last two turns, or, for an agent asked once, one turn of every agent
known (a round among them all); an agent later than that is expected as far off as it
has been idle. In a round robin that evicts the agent that spoke last; with a main agent
and helpers, the helper that spoke last before the main agent. An agent whose last two
periods were the same is asked in a *regular* order: its expectation is firm enough to
bring its cache back ahead of its turn (:mod:`._prefetch`).
"""

from __future__ import annotations


class NextUse:
    """Turns started, by agent, and when each agent's next one is expected."""

    def __init__(self) -> None:
        self.turns = 0
        self._last: dict[str, int] = {}
        self._period: dict[str, int] = {}
        self._regular: set[str] = set()

    def started(self, agent: str) -> None:
        """A turn of ``agent`` started."""
        last = self._last.get(agent)
        if last is not None:
            period = self.turns - last
            if self._period.get(agent) == period:
                self._regular.add(agent)
            else:
                self._regular.discard(agent)
            self._period[agent] = period
        self._last[agent] = self.turns
        self.turns += 1

    def forget(self, agent: str) -> None:
        self._last.pop(agent, None)
        self._period.pop(agent, None)
        self._regular.discard(agent)

    def regular(self, agent: str) -> bool:
        """Whether the agent's last two periods were the same."""
        return agent in self._regular

    def expected_in(self, agent: str) -> int:
        """Turns from now until ``agent``'s next turn is expected (at least 1)."""
        last = self._last.get(agent)
        if last is None:
            return len(self._last) + 1  # never asked: after a round of those that were
        due = last + self._period.get(agent, len(self._last))
        if due >= self.turns:
            return due - self.turns + 1
        return self.turns - last  # late: expected as far off as it has been idle
