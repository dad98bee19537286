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
and helpers, the helper that spoke last before the main agent.
"""

from __future__ import annotations


class NextUse:
    """Turns started, by agent, and when each agent's next one is expected."""

    def __init__(self) -> None:
        self.turns = 0
        self._last: dict[str, int] = {}
        self._period: dict[str, int] = {}

    def started(self, agent: str) -> None:
        """A turn of ``agent`` started."""
        last = self._last.get(agent)
        if last is not None:
            self._period[agent] = self.turns - last
        self._last[agent] = self.turns
        self.turns += 1

    def forget(self, agent: str) -> None:
        self._last.pop(agent, None)
        self._period.pop(agent, None)

    def expected_in(self, agent: str) -> int:
        """Turns from now until ``agent``'s next turn is expected (at least 1)."""
        last = self._last.get(agent)
        if last is None:
            return len(self._last) + 1  # never asked: after a round of those that were
        due = last + self._period.get(agent, len(self._last))
        if due >= self.turns:
            return due - self.turns + 1
        return self.turns - last  # late: expected as far off as it has been idle
