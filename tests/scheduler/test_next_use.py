"""When each agent is expected to be asked next (the cache manager's eviction order)."""

from __future__ import annotations

from mlx_actors.scheduler.residency._next_use import NextUse


def expected(next_use: NextUse, agents: list[str]) -> dict[str, int]:
    return {a: next_use.expected_in(a) for a in agents}


def test_a_round_robin_expects_the_least_recent_speaker_next() -> None:
    agents = [f"a{i}" for i in range(5)]
    next_use = NextUse()
    for _ in range(3):
        for agent in agents:
            next_use.started(agent)
    # the agent that spoke last is expected furthest away: a round from now
    assert expected(next_use, agents) == {"a0": 1, "a1": 2, "a2": 3, "a3": 4, "a4": 5}


def test_a_main_agent_between_helpers_is_expected_next() -> None:
    next_use = NextUse()
    for _ in range(2):
        for helper in ("h1", "h2", "h3", "h4"):
            next_use.started("main")
            next_use.started(helper)
    assert expected(next_use, ["main", "h1", "h2", "h3", "h4"]) == {
        "main": 1,
        "h1": 2,
        "h2": 4,
        "h3": 6,
        "h4": 8,
    }


def test_agents_asked_once_are_expected_after_a_round_of_all() -> None:
    next_use = NextUse()
    for agent in ("a", "b", "c"):
        next_use.started(agent)
    assert expected(next_use, ["a", "b", "c"]) == {"a": 1, "b": 2, "c": 3}
    assert next_use.expected_in("never") == 4  # not asked yet: after those that were


def test_an_agent_past_its_time_is_expected_as_far_off_as_it_has_been_idle() -> None:
    next_use = NextUse()
    for agent in ("old", "x", "old", "x"):  # period 2
        next_use.started(agent)
    for _ in range(6):
        next_use.started("x")
    assert next_use.expected_in("old") == 8  # idle for 8 turns, due 6 turns ago
    next_use.forget("old")
    assert next_use.expected_in("old") == next_use.expected_in("never")


def test_an_agent_is_regular_once_its_last_two_periods_agree() -> None:
    next_use = NextUse()
    for agent in ["a", "b", "c", "a", "b", "a", "c", "b", "a", "c", "b"]:
        next_use.started(agent)
    # a: periods 3, 2, 3; b: 3, 3, 3; c: 4, 3
    assert [next_use.regular(agent) for agent in "abc"] == [False, True, False]
    next_use.forget("b")
    assert not next_use.regular("b") and not next_use.regular("d")
