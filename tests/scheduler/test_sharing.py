"""Prefix sharing in the engine: any sequence starts from blocks any agent computed, a
prefix shared by sequences submitted together is prefilled once, shared blocks are held
once and freed with their last holder; every reply stays token-identical to mlx-lm."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import AgentClosedError, InvalidRequestError
from mlx_actors.scheduler import BLOCK_SIZE, AgentBlocks, BlockPool, BlockPoolBatchEngine
from mlx_actors.scheduler.engine import _batch
from mlx_actors.scheduler.residency import make_blocks, take_image
from mlx_actors.testing import tiny_config, write_random_model

from ..actors.test_agents import FaultyRuntime, long_question
from ..conftest import (
    Loaded,
    ReferenceChat,
    asyncio_only,
    load,
    reference,
    render,
    run_to_completion,
)
from .test_engine import N, prompt
from .test_families import FAMILIES

# What these tests check does not depend on the event loop.
anyio_backend = asyncio_only()

#: A shared brief: two whole blocks and part of a third.
BRIEF = prompt(2 * BLOCK_SIZE + 188, 1)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected(tiny: Loaded, tokens: list[int], n: int = N) -> list[int]:
    return reference(tiny.model, tokens, n, stop=tiny.tokenizer.eos_token_ids)


def held(pool: BlockPool, *caches: AgentBlocks) -> None:
    """The pool holds exactly the distinct blocks of ``caches``, each referenced once
    per holder, and nothing is reserved."""
    refs: dict[int, int] = {}
    units = 0
    for blocks in caches:
        for b in blocks.blocks():
            units += 0 if b.id in refs else pool.spec.units(b.layer)
            refs[b.id] = refs.get(b.id, 0) + 1
    stats = pool.statistics()
    assert (stats.used_blocks, stats.reserved_blocks) == (units, 0)
    for blocks in caches:
        for b in blocks.blocks():
            assert pool.references(b) == refs[b.id]


def test_a_prefix_one_agent_computed_is_reused_and_held_once(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    first, second = [*BRIEF, *prompt(30, 2)], [*BRIEF, *prompt(40, 3)]
    uid = engine.submit("ann", first, max_tokens=N)
    ann = run_to_completion(engine)[uid]
    uid = engine.submit("bob", second, max_tokens=N)
    bob = run_to_completion(engine)[uid]
    assert list(ann.tokens) == expected(tiny, first)
    assert list(bob.tokens) == expected(tiny, second)
    shared = common(first, second)
    assert bob.usage.cached_tokens == bob.usage.shared_tokens == shared
    assert bob.usage.prompt_tokens == len(second) - shared
    for a, b in zip(ann.blocks.layers, bob.blocks.layers):
        assert b[:2] == a[:2]  # the whole blocks of the brief: the same KVBlocks
        assert b[2] is not a[2]  # the block where they diverge is each one's own
    held(engine.pool, ann.blocks, bob.blocks)
    # a shared block goes when its last holder lets go, not before
    brief_blocks = [b for layer in bob.blocks.layers for b in layer[:2]]
    engine.release(ann.blocks)
    assert all(engine.pool.owns(b) for b in brief_blocks)
    held(engine.pool, bob.blocks)
    engine.release(bob.blocks)
    assert not any(engine.pool.owns(b) for b in brief_blocks)
    assert engine.pool.used_blocks == 0 and engine.index.nodes == 0  # nothing left


def test_a_prefix_shared_by_sequences_submitted_together_is_prefilled_once(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    prompts = [[*BRIEF, *prompt(20 + 7 * i, 10 + i)] for i in range(4)]
    uids = [engine.submit(f"agent{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    admissions = [engine.admission(uid) for uid in uids]
    assert admissions[0] is not None and admissions[0].waits_for is None
    for a, p in zip(admissions[1:], prompts[1:]):
        assert a is not None and a.waits_for == "agent0"
        assert a.waits_tokens == common(p, prompts[0])
    done = run_to_completion(engine)
    results = [done[uid] for uid in uids]
    for result, p in zip(results, prompts):
        assert list(result.tokens) == expected(tiny, p)
    # the first prefilled all of its prompt; the others only what follows the brief
    assert results[0].usage.prompt_tokens == len(prompts[0])
    for result, p in zip(results[1:], prompts[1:]):
        assert result.usage.cached_tokens == result.usage.shared_tokens == common(p, prompts[0])
    stats = engine.statistics()
    assert stats.prefill_tokens == sum(r.usage.prompt_tokens for r in results)
    assert stats.prefill_tokens < len(BRIEF) + 4 * 60
    assert (stats.prefill_jobs, stats.checkpoints) == (1, 1)
    held(engine.pool, *(r.blocks for r in results))
    for r in results:
        engine.release(r.blocks)
    assert engine.pool.used_blocks == 0


def test_sequences_joining_together_on_the_same_blocks_gather_them_once(
    engine: BlockPoolBatchEngine, tiny: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three agents ask at once on a brief another agent's blocks hold, while a fourth
    decodes: they join the batch as one batch of prompts, their common history gathered
    from the blocks once (each with cache objects of its own over the same arrays), and
    each reply is mlx-lm's own."""
    first = [*BRIEF, *prompt(30, 2)]
    uid = engine.submit("ann", first, max_tokens=N)
    ann = run_to_completion(engine)[uid]
    busy = prompt(50, 9)
    bob = engine.submit("bob", busy, max_tokens=3 * N)
    engine.step()  # bob decodes: the others join a busy batch
    gathered: list[int] = []
    gather = _batch.to_cache

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathered.append(args[2])  # the tokens gathered
        return gather(*args, **kwargs)

    monkeypatch.setattr(_batch, "to_cache", counted)
    prompts = [[*BRIEF, *prompt(20 + 3 * i, 20 + i)] for i in range(3)]
    uids = [engine.submit(f"c{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    done = run_to_completion(engine)
    shared = {common(p, first) for p in prompts}
    assert len(shared) == 1 and gathered == list(shared)  # one gather for the three
    assert list(done[bob].tokens) == expected(tiny, busy, 3 * N)
    for uid, p in zip(uids, prompts):
        assert list(done[uid].tokens) == expected(tiny, p)
        assert done[uid].usage.shared_tokens == common(p, first)
    for result in (ann, *done.values()):
        engine.release(result.blocks)
    assert engine.pool.used_blocks == 0


@pytest.mark.parametrize("cancelled", ["owner", "waiter"])
def test_cancelling_either_side_of_a_shared_prefill_leaves_the_other_exact(
    engine: BlockPoolBatchEngine, tiny: Loaded, cancelled: str
) -> None:
    prompts = [[*BRIEF, *prompt(25, 20 + i)] for i in range(3)]
    uids = [engine.submit(f"agent{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    engine.step()  # the first chunk of agent0's prefill ran; the others wait for it
    gone = uids[0] if cancelled == "owner" else uids[1]
    assert engine.cancel(gone)
    done = run_to_completion(engine)
    assert gone not in done
    for uid, p in zip(uids, prompts):
        if uid != gone:
            assert list(done[uid].tokens) == expected(tiny, p)
    held(engine.pool, *(r.blocks for r in done.values()))
    for r in done.values():
        engine.release(r.blocks)
    assert engine.pool.used_blocks == 0


def test_a_turn_that_arrives_while_a_long_prefill_runs_waits_for_its_prefix(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    talker = prompt(30, 6)  # decoding meanwhile: the job's chunks stay short
    busy = engine.submit("carl", talker, max_tokens=60)
    engine.step()
    long = [*BRIEF, *prompt(1200, 4)]  # long enough to be prefilled as a job
    first = engine.submit("ann", long, max_tokens=N)
    engine.step()
    engine.step()  # two chunks of it ran: 1024 tokens, past the brief
    late = [*long[:1500], *prompt(20, 5)]  # shares 1500 tokens, not yet computed
    uid = engine.submit("bob", late, max_tokens=N)
    admission = engine.admission(uid)
    assert admission is not None and admission.waits_for == "ann"
    done = run_to_completion(engine)
    assert list(done[first].tokens) == expected(tiny, long)
    assert list(done[uid].tokens) == expected(tiny, late)
    assert list(done[busy].tokens) == expected(tiny, talker, 60)
    assert done[uid].usage.cached_tokens >= 1500
    for r in done.values():
        engine.release(r.blocks)
    assert engine.pool.used_blocks == 0


def test_without_sharing_each_agent_computes_its_own(tiny: Loaded) -> None:
    pool = BlockPool(tiny.spec, total_blocks=200)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, share_prefixes=False)
    prompts = [[*BRIEF, *prompt(30, 30 + i)] for i in range(3)]
    uids = [engine.submit(f"agent{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    done = run_to_completion(engine)
    for uid, p in zip(uids, prompts):
        assert list(done[uid].tokens) == expected(tiny, p)
        assert done[uid].usage.cached_tokens == 0
    assert pool.statistics().shared_blocks == 0
    # an agent still continues from its own blocks
    blocks = done[uids[0]].blocks
    uid = engine.submit("agent0", prompt(10, 40), blocks, max_tokens=N)
    again = run_to_completion(engine)[uid]
    assert again.usage.cached_tokens == blocks.num_tokens and again.usage.shared_tokens == 0
    for r in [*done.values(), again]:
        engine.release(r.blocks)
    assert pool.used_blocks == 0 and engine.index.nodes == 0  # no namespace left behind


@pytest.fixture(scope="module", params=["llama", "gemma3-window-300"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """The tests' llama, and a Gemma-3 shape whose window spans blocks, as real ones do
    (kept boundaries then share chunks with the window's blocks)."""
    if request.param == "llama":
        config = tiny_config(num_hidden_layers=3)
    else:
        config = tiny_config(
            "gemma3_text",
            num_hidden_layers=2,
            sliding_window=300,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
        )
    path = tmp_path_factory.mktemp("shared-models") / request.param
    return load(write_random_model(path, config, seed=7, init_scale=4.0))


def test_no_leaks_when_agents_share_prefixes_and_turns_fail(model: Loaded) -> None:
    """Random turns of agents that share briefs (some cancelled while they wait for a
    prefix, prefill it, or decode): the pool always holds exactly the distinct blocks
    the agents hold, and every reply is mlx-lm's."""
    tiny = model
    pool = BlockPool(tiny.spec, total_blocks=160)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, max_batch_size=4)
    rng = random.Random(11)
    briefs = [prompt(300 + 170 * i, 50 + i) for i in range(2)]
    live: dict[str, AgentBlocks] = {}
    in_flight: dict[int, tuple[str, list[int], int]] = {}
    cancelled = finished = 0
    for round_ in range(8):
        agents = rng.sample([f"agent{i}" for i in range(6)], rng.randrange(2, 5))
        for agent in agents:
            cache = live.get(agent) if rng.random() < 0.35 else None
            tail = prompt(rng.randrange(3, 60), 100 * round_ + len(in_flight))
            new = [*rng.choice(briefs), *tail]
            full = [*cache.tokens, *new] if cache is not None else new
            budget = rng.randrange(1, 20)
            uid = engine.submit(agent, new, cache, max_tokens=budget)
            in_flight[uid] = (agent, full, budget)
        results = {}
        for _ in range(rng.randrange(0, 4)):
            results.update((r.uid, r) for r in engine.step())
        running = sorted(set(in_flight) - set(results))
        for uid in rng.sample(running, min(len(running), rng.randrange(0, 3))):
            assert engine.cancel(uid)
            del in_flight[uid]
            cancelled += 1
        results.update(run_to_completion(engine))
        for uid, result in results.items():
            agent, full, budget = in_flight.pop(uid)
            assert list(result.tokens) == expected(tiny, full, budget)
            engine.release(live.get(agent))
            live[agent] = result.blocks
            finished += 1
        held(pool, *live.values())
    assert finished >= 12 and cancelled >= 3
    stats = engine.statistics()
    assert stats.shared_tokens > 0 and stats.prefill_jobs > 0
    for blocks in live.values():
        engine.release(blocks)
    assert pool.used_blocks == 0


# -- agents that share: a team with one brief, forks, every family ----------------------

#: A brief every member of a team reads (600 tokens with the tests' byte tokenizer).
TEAM_BRIEF = (
    "Brief: the city council asks for a plan to green the old harbour district. "
    "It holds warehouses, a rail yard, two schools and a fish market. The budget is "
    "tight, the ground is polluted in places, and the residents want to be heard. "
) * 3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("sharing") / request.param
    return load(write_random_model(path, FAMILIES[request.param], seed=11, init_scale=4.0))


def check_dialogue(loaded: Loaded, history: tuple[Any, ...], replies: list[Any], n: int) -> None:
    """``replies`` are what mlx-lm gives for ``history`` through one persistent cache."""
    chat = ReferenceChat(loaded.model, loaded.tokenizer.eos_token_ids)
    system = 1 if history and history[0].role == "system" else 0
    for turn, reply in enumerate(replies):
        prompt = render(loaded.tokenizer, history[: system + 1 + 2 * turn])
        assert list(reply.tokens) == chat.turn(prompt, n), turn


async def team(
    path: Path, *, critics: int = 3, together: bool = True, **options: Any
) -> tuple[dict[str, list[Any]], Any, dict[str, Any]]:
    """Critics read one brief and are asked (together, or one after another); then one
    forks, and all go on.

    Turns asked together share the brief when they reach the engine within its admission
    window of each other; the window is long here so that a loaded machine, rendering
    them slowly, still starts them as one batch."""
    replies: dict[str, list[Any]] = {}
    options.setdefault("admission_window", 1.0)
    async with Runtime(path, log_level="off", **options) as rt:
        agents = [
            await rt.spawn(f"critic{i}", system=f"{TEAM_BRIEF}\nYou are critic {i}.", max_tokens=12)
            for i in range(critics)
        ]

        async def ask(agent: Any, text: str) -> None:
            replies.setdefault(agent.name, []).append(await agent.ask(text))

        async def round_(agents: list[Any], text: str) -> None:
            if not together:
                for agent in agents:
                    await ask(agent, text.format(agent.name))
                return
            async with anyio.create_task_group() as tg:
                for agent in agents:
                    tg.start_soon(ask, agent, text.format(agent.name))

        await round_(agents, "What worries you most?")
        second = await agents[0].fork("second_opinion")
        replies["second_opinion"] = list(replies["critic0"])
        await round_([*agents, second], "And what would {} do first?")
        stats = await rt.stats()
        histories = {a.name: a.history for a in rt.agents.values()}
    return replies, stats, histories


def tokens_of(replies: dict[str, list[Any]]) -> dict[str, list[tuple[int, ...]]]:
    return {agent: [r.tokens for r in rs] for agent, rs in replies.items()}


@pytest.mark.anyio
async def test_a_team_reading_one_brief_prefills_it_once_and_stays_exact(
    family: Loaded, anyio_backend: str
) -> None:
    replies, stats, histories = await team(family.path, pool_blocks=400)
    for name, history in histories.items():
        check_dialogue(family, history, replies[name], 12)
    firsts = [replies[f"critic{i}"][0].usage for i in range(3)]
    # one critic prefilled the brief; the others started from its blocks
    assert sorted(u.shared_tokens > len(TEAM_BRIEF) for u in firsts) == [False, True, True]
    assert stats.shared_tokens > 2 * len(TEAM_BRIEF)
    # the fork's turn prefilled only its new question: the history came with the fork
    fork, parent = replies["second_opinion"][1].usage, replies["critic0"][0]
    assert fork.shared_tokens == 0 and fork.prompt_tokens < fork.cached_tokens / 5
    assert fork.cached_tokens >= parent.usage.cached_tokens + parent.usage.prompt_tokens
    assert stats.shared_blocks > 0 and stats.shared_bytes > 0
    assert stats.pool.used_blocks == stats.resident_blocks


def test_replies_with_sharing_equal_replies_without_and_after_eviction(family: Loaded) -> None:
    def run(**options: Any) -> tuple[dict[str, list[Any]], Any, dict[str, Any]]:
        return anyio.run(lambda: team(family.path, **options))

    shared, with_stats, _ = run(pool_blocks=400)
    alone, alone_stats, _ = run(pool_blocks=400, share_prefixes=False)
    assert tokens_of(shared) == tokens_of(alone)
    assert with_stats.prefill_tokens < alone_stats.prefill_tokens
    assert alone_stats.shared_tokens == 0 and with_stats.shared_tokens > 0
    assert with_stats.shared_bytes > alone_stats.shared_bytes  # without: the fork's only
    if not family.spec.sliding_layers:  # sliding layers keep the shared boundary's window
        assert with_stats.resident_blocks < alone_stats.resident_blocks
    # six critics one after another through a pool that holds about two of them
    roomy, _, _ = run(critics=6, together=False, pool_blocks=400)
    tight, tight_stats, _ = run(
        critics=6, together=False, pool_blocks=3 * family.spec.num_layers + 20
    )
    assert tokens_of(tight) == tokens_of(roomy)
    assert tight_stats.evictions > 0 and tight_stats.restores > 0
    assert tight_stats.pool.used_blocks == tight_stats.resident_blocks


@pytest.mark.anyio
async def test_a_fork_holds_the_parent_cache_by_reference(tiny: Loaded, tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        writer = await rt.spawn("writer", system=TEAM_BRIEF, max_tokens=16, temperature=0.0)
        draft = await writer.ask("Write a first draft.")
        before = await rt.stats()
        critic = await writer.fork("critic", max_tokens=8)
        after = await rt.stats()
        # nothing copied, nothing prefilled: the same blocks, one more holder each
        assert after.pool.used_blocks == before.pool.used_blocks
        assert after.resident_blocks == before.resident_blocks
        assert after.shared_blocks == before.resident_blocks
        assert critic.history == writer.history and critic.options.max_tokens == 8
        assert critic.statistics().cached_tokens == writer.statistics().cached_tokens
        review = await critic.ask("Now criticise the draft.")
        # all the history before the draft, at least (a reply cut mid-character can
        # re-render differently at its end)
        assert review.usage.cached_tokens >= draft.usage.cached_tokens + draft.usage.prompt_tokens
        assert len(review.tokens) <= 8
        # the parent never sees the fork's turn
        assert [m.content for m in writer.history][-1] == draft.text
        with pytest.raises(InvalidRequestError, match="already exists"):
            await writer.fork("critic")
        with pytest.raises(InvalidRequestError, match="names"):
            await writer.fork("not a name")
        await critic.close()
        await writer.close()
        with pytest.raises(AgentClosedError):
            await writer.fork("again")
        stats = await rt.stats()
        assert stats.pool.used_blocks == 0


@pytest.mark.anyio
async def test_a_fork_and_its_idle_parent_take_turns_in_a_pool_that_holds_one(
    tiny_dir: Path,
) -> None:
    brief = "A long brief every agent reads first. " * 12  # two blocks a layer

    async def dialogue(pool_blocks: int) -> tuple[list[tuple[int, ...]], int]:
        async with Runtime(tiny_dir, pool_blocks=pool_blocks, log_level="off") as rt:
            ann = await rt.spawn("ann", system=brief, max_tokens=12)
            await ann.ask("Turn 0")
            bob = await ann.fork("bob")
            replies = []
            for turn in (1, 2, 3):
                # bob asks what ann just asked: her newer blocks hold his prompt too, but
                # holding them would keep her idle cache from moving to disk
                for agent in (ann, bob):
                    replies.append((await agent.ask(f"Turn {turn}")).tokens)
            return replies, (await rt.stats()).evictions

    tight, evictions = await dialogue(12)
    roomy, _ = await dialogue(400)
    assert evictions > 0 and tight == roomy


def test_a_state_directory_stores_a_shared_block_once_and_a_restart_shares_it_again(
    family: Loaded, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    follow_up = "Sum it up in one line."

    async def go_on(rt: Runtime) -> dict[str, Any]:  # one after another: each restored
        return {name: await rt.agent(name).ask(follow_up) for name in sorted(rt.agents)}

    async def first() -> dict[str, list[Any]]:
        replies, _, _ = await team(family.path, pool_blocks=400, state_dir=state)
        return replies

    async def restarted() -> tuple[dict[str, Any], Any]:
        async with Runtime(family.path, pool_blocks=400, log_level="off", state_dir=state) as rt:
            replies = await go_on(rt)
            return replies, await rt.stats()

    async def uninterrupted() -> dict[str, Any]:
        replies: dict[str, Any] = {}
        async with Runtime(family.path, pool_blocks=400, log_level="off") as rt:
            agents = [
                await rt.spawn(
                    f"critic{i}", system=f"{TEAM_BRIEF}\nYou are critic {i}.", max_tokens=12
                )
                for i in range(3)
            ]
            async with anyio.create_task_group() as tg:
                for agent in agents:
                    tg.start_soon(agent.ask, "What worries you most?")
            second = await agents[0].fork("second_opinion")
            async with anyio.create_task_group() as tg:
                for agent in [*agents, second]:
                    tg.start_soon(agent.ask, f"And what would {agent.name} do first?")
            replies = await go_on(rt)
        return replies

    saved = anyio.run(first)
    # every block is stored once: one place per content key, whichever agents hold it
    places: dict[str, set[str]] = {}
    entries = 0
    for index_file in (state / "caches").glob("*/index.json"):
        for row in json.loads(index_file.read_text())["layers"]:
            for _, _, ref, key in row:
                places.setdefault(key, set()).add(ref)
                entries += 1
    assert all(len(refs) == 1 for refs in places.values())
    assert len(places) < entries  # the brief's blocks are listed by every critic
    assert len(list((state / "caches").glob("*/index.json"))) == len(saved)
    replies, stats = anyio.run(restarted)
    expected_replies = anyio.run(uninterrupted)
    assert {n: r.tokens for n, r in replies.items()} == {
        n: r.tokens for n, r in expected_replies.items()
    }
    # the caches came back as shared blocks, not as copies
    assert stats.restores == len(saved) and stats.shared_bytes > 0
    assert stats.pool.used_blocks == stats.resident_blocks


def test_a_restore_reserves_only_the_blocks_nobody_holds(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    prompts = [[*BRIEF, *prompt(20, 60 + i)] for i in range(2)]
    uids = [engine.submit(f"agent{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    done = run_to_completion(engine)
    first, second = (done[uid].blocks for uid in uids)
    image = take_image(first, {}, tiny.spec.layers[0].dtype, 1)
    engine.release(first)  # evicted: only the brief, which the other agent holds, stays
    brief = sum(1 for layer in second.layers for b in layer if b.end <= 2 * BLOCK_SIZE)
    asked: list[int] = []

    def reserve(n: int) -> Any:
        asked.append(n)
        return engine.pool.reserve(n)

    back = make_blocks(engine.pool, image, reserve, index=engine.index)
    assert asked == [image.num_blocks - brief]  # the brief's blocks were shared
    for a, b in zip(back.layers, second.layers):
        assert a[:2] == b[:2]
    held(engine.pool, back, second)
    nxt = prompt(10, 70)
    uid = engine.submit("agent0", nxt, back, max_tokens=N)
    again = run_to_completion(engine)[uid]
    assert list(again.tokens) == expected(tiny, [*back.tokens, *nxt])
    for blocks in (back, second, again.blocks):
        engine.release(blocks)
    assert engine.pool.used_blocks == 0


@pytest.mark.anyio
async def test_two_forks_racing_for_one_name(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        parents = [await rt.spawn(f"parent{i}", max_tokens=6) for i in range(2)]
        for parent in parents:
            await parent.ask(f"Hello from {parent.name}.")
        outcomes: list[Any] = []

        async def fork(parent: Any) -> None:
            try:
                outcomes.append(await parent.fork("kid"))
            except InvalidRequestError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for parent in parents:
                tg.start_soon(fork, parent)
        assert sorted(type(o).__name__ for o in outcomes) == ["Agent", "InvalidRequestError"]
        for agent in list(rt.agents.values()):
            await agent.close()
        stats = await rt.stats()
        assert (stats.pool.used_blocks, stats.resident_blocks) == (0, 0)


@pytest.mark.anyio
async def test_a_shared_block_stays_while_a_turn_in_flight_reads_it(
    tiny: Loaded, tiny_dir: Path
) -> None:
    # 23 blocks: ann's cache of two turns (four blocks a layer, the last hers alone),
    # bob's turn on the brief (three more a layer at most), and no room left for carl's
    # three unless ann's cache goes; bob reads her first three blocks a layer.
    async with FaultyRuntime(tiny_dir, pool_blocks=23, log_level="off") as rt:
        ann = await rt.spawn("ann", system=TEAM_BRIEF, max_tokens=8)
        bob = await rt.spawn("bob", system=TEAM_BRIEF, max_tokens=8)
        carl = await rt.spawn("carl", max_tokens=8)
        await ann.ask("Hi")
        await ann.ask("Tell me more about the market and the schools.")
        assert ann.statistics().cached_blocks == 12
        question = long_question(tiny, bob.history, tokens=300)
        rt.faulty.delay = 0.005
        async with bob.stream(question, max_tokens=300) as running:
            await anext(running)  # bob's turn runs on the brief's blocks, which ann holds
            first = await carl.ask("Hello")  # room for carl: ann's cache goes to disk
            assert ann.statistics().on_disk
            rt.faulty.delay = 0
            pieces = [piece async for piece in running]
        reply = running.reply
        assert reply.usage.shared_tokens >= len(TEAM_BRIEF)  # it read ann's blocks
        prompt = render(tiny.tokenizer, bob.history[:-1])
        assert list(reply.tokens) == expected(tiny, prompt, 300)
        assert pieces
        assert list(first.tokens) == expected(tiny, render(tiny.tokenizer, carl.history[:-1]), 8)
        again = await ann.ask("Still there?")  # her cache comes back from disk
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        for turn in range(2):
            chat.turn(render(tiny.tokenizer, ann.history[: 2 + 2 * turn]), 8)
        assert list(again.tokens) == chat.turn(render(tiny.tokenizer, ann.history[:6]), 8)
        stats = await rt.stats()
        assert stats.pool.used_blocks == stats.resident_blocks


@pytest.mark.anyio
async def test_idle_agents_that_share_every_block_are_evicted_together(tiny_dir: Path) -> None:
    """A parent and its fork share all their blocks: evicting either alone frees
    nothing. Before, neither was evicted and a third agent's turn was refused with
    ``PoolExhaustedError`` with no turn in flight; both now go to disk and come back
    exactly."""

    async def run(pool_blocks: int) -> tuple[list[tuple[int, ...]], int]:
        async with Runtime(tiny_dir, pool_blocks=pool_blocks, log_level="off") as rt:
            ann = await rt.spawn("ann", max_tokens=4)
            replies = [(await ann.ask("word " * 110)).tokens]  # 3 blocks a layer
            bob = await ann.fork("bob")  # the same 9 blocks
            cid = await rt.spawn("cid", max_tokens=4)
            replies.append((await cid.ask("hello " * 50)).tokens)  # needs 6 of 12
            for agent in (bob, ann):
                replies.append((await agent.ask("And then?")).tokens)
            return replies, (await rt.stats()).evictions

    tight, evictions = await run(12)
    roomy, none = await run(100)
    assert evictions >= 2 and none == 0
    assert tight == roomy
