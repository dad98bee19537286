"""Agents on the real engine: replies equal mlx-lm's, history is never re-prefilled,
turns share batches, and every failure leaves the agent as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from mlx_actors import Runtime
from mlx_actors.actors._render import RecentRenderings
from mlx_actors.errors import (
    AgentClosedError,
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    RuntimeClosedError,
    TurnTimeoutError,
    UnknownAgentError,
)

from ..conftest import Loaded, ReferenceChat, reference, render
from ..scheduler.test_engine import Faulty

pytestmark = pytest.mark.anyio

QUESTIONS = [
    "Hello! Who are you?",
    "Tell me about the sea.",
    "Why is the sky blue?",
    "Count to five.",
    "Say goodbye.",
]


def runtime(path: Path, **options: Any) -> Runtime:
    return Runtime(path, **{"pool_blocks": 400, "log_level": "off", **options})


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def held_by_agents(rt: Runtime) -> int:
    return sum(a.statistics().cached_blocks for a in rt.agents.values())


async def test_a_dialogue_equals_mlx_lm_through_a_persistent_cache(
    tiny: Loaded, tiny_dir: Path
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    chat = ReferenceChat(tiny.model, eos)
    previous: list[int] = []  # what the agent's cache holds after each turn
    previous_prompt = 0
    async with runtime(tiny_dir) as rt:
        alice = await rt.spawn("alice", system="You are Alice.", max_tokens=30)
        for i, question in enumerate(QUESTIONS):
            reply = await alice.ask(question)
            prompt = render(tiny.tokenizer, alice.history[:-1])
            assert list(reply.tokens) == chat.turn(prompt, 30), f"turn {i}"
            assert str(reply) == reply.text == alice.history[-1].content
            # history comes from the cache: only what the cache lacks is prefilled
            usage = reply.usage
            assert usage.cached_tokens == common_prefix(previous, prompt)
            assert usage.cached_tokens + usage.prompt_tokens == len(prompt)
            assert usage.cached_tokens >= previous_prompt  # at least all earlier turns
            previous, previous_prompt = [*prompt, *reply.tokens], len(prompt)
            assert 0 < reply.ttft_s <= reply.total_s
        assert [m.role for m in alice.history] == ["system"] + ["user", "assistant"] * 5
        stats = await rt.stats()
        assert stats.turns == 5
        assert stats.cached_tokens > stats.prefill_tokens
        assert stats.pool.used_blocks == await held_by_agents(rt)


@pytest.mark.parametrize("share", [True, False])
async def test_a_new_agent_encodes_only_what_it_does_not_share_with_recent_ones(
    tiny: Loaded, tiny_dir: Path, share: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RecentRenderings, "MIN_CHARS", 200)  # within the tiny context
    brief = "Read this brief with care. " * 20  # longer than a rendering worth keeping
    async with runtime(tiny_dir, share_prefixes=share) as rt:
        ann = await rt.spawn("ann", system=brief, max_tokens=4)
        bob = await rt.spawn("bob", system=brief, max_tokens=4)
        await ann.ask("Hello there.")
        reply = await bob.ask("What does it say?")
        rendering = bob._turns._rendering
        assert rendering is not None
        assert list(rendering.tokens) == render(tiny.tokenizer, bob.history[:-1])
        assert len(reply.tokens) > 0
        # With sharing, bob's first rendering starts from ann's: only the text after the
        # brief is encoded; without it, nothing of another agent's is read.
        assert (rendering.reused > len(brief) // 10) is share


async def test_eight_agents_share_batches_and_match_single_references(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "run.jsonl"
    replies: dict[str, Any] = {}
    async with runtime(tiny_dir, trace=trace) as rt:
        agents = [
            await rt.spawn(f"agent{i}", system=f"You are agent {i}.", max_tokens=24)
            for i in range(8)
        ]

        async def ask(agent: Any) -> None:
            replies[agent.name] = await agent.ask("What do you think of the sea?")

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(ask, agent)
        histories = {a.name: a.history for a in agents}
    for name, reply in replies.items():
        prompt = render(tiny.tokenizer, histories[name][:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 24, stop=tiny.tokenizer.eos_token_ids
        )
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    batches = [e["batch"] for e in events if e["event"] == "batch.step"]
    assert max(batches) >= 4, batches
    finished = [e for e in events if e["event"] == "turn.finished"]
    assert len(finished) == 8
    assert {
        "agent",
        "turn",
        "prefill_tokens",
        "cached_tokens",
        "generated_tokens",
        "ttft_ms",
        "total_ms",
        "pool_used",
        "timestamp",
        "level",
    } <= set(finished[0])
    admitted = [e for e in events if e["event"] == "turn.admitted"]
    assert len(admitted) == 8 and all("batch" in e and "queued_ms" in e for e in admitted)


async def test_a_cancelled_turn_leaves_the_agent_as_it_was(tiny: Loaded, tiny_dir: Path) -> None:
    async with runtime(tiny_dir) as rt:
        bob = await rt.spawn("bob", system="You are Bob.", max_tokens=20)
        await bob.ask(QUESTIONS[0])
        before = (bob.history, bob.statistics())
        used = (await rt.stats()).pool.used_blocks
        pieces = []
        with anyio.CancelScope() as scope:
            async with bob.stream(QUESTIONS[1], max_tokens=3000) as stream:
                async for piece in stream:
                    pieces.append(piece)
                    scope.cancel()
        assert pieces and scope.cancelled_caught
        assert (bob.history, bob.statistics()) == before
        stats = await rt.stats()
        assert (stats.pool.used_blocks, stats.pool.reserved_blocks) == (used, 0)
        assert stats.turns_in_flight == 0
        # the next turn is what it would have been had the cancelled one never run
        reply = await bob.ask(QUESTIONS[2])
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        chat.turn(render(tiny.tokenizer, bob.history[:2]), 20)
        assert list(reply.tokens) == chat.turn(render(tiny.tokenizer, bob.history[:-1]), 20)


class FaultyRuntime(Runtime):
    """A runtime whose real model can be made to fail its next forward pass."""

    def _load(self) -> tuple[Any, Any]:
        model, tokenizer = super()._load()
        self.faulty = Faulty(model)
        return self.faulty, tokenizer


def long_question(tiny: Loaded, history: Any, tokens: int = 150) -> str:
    """A question whose greedy reply runs at least ``tokens`` tokens without ending."""
    for question in ["Go on.", "Tell me everything.", "Continue the story.", *QUESTIONS]:
        prompt = render(tiny.tokenizer, [*history, {"role": "user", "content": question}])
        if len(reference(tiny.model, prompt, tokens, stop=tiny.tokenizer.eos_token_ids)) == tokens:
            return question
    raise AssertionError("no question gives a long reply")


async def test_a_timed_out_turn_is_cancelled_and_the_agent_keeps_serving(
    tiny: Loaded, tiny_dir: Path
) -> None:
    async with FaultyRuntime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        carol = await rt.spawn("carol", max_tokens=20)
        first = await carol.ask(QUESTIONS[0])
        before = (carol.history, carol.statistics())
        question = long_question(tiny, carol.history)
        rt.faulty.delay = 0.005  # 150 tokens now take at least 0.75 s
        with pytest.raises(TurnTimeoutError, match=r"0\.2 s") as info:
            await carol.ask(question, max_tokens=150, timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        assert (carol.history, carol.statistics()) == before
        stats = await rt.stats()
        assert stats.pool.used_blocks == await held_by_agents(rt)
        assert (stats.pool.reserved_blocks, stats.turns_in_flight) == (0, 0)
        rt.faulty.delay = 0
        again = await carol.ask(QUESTIONS[1])
        assert again.usage.cached_tokens >= len(first.tokens)


async def test_the_timeout_covers_waiting_in_the_mailbox(tiny: Loaded, tiny_dir: Path) -> None:
    async with FaultyRuntime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        dave = await rt.spawn("dave", max_tokens=20)
        question = long_question(tiny, [])
        rt.faulty.delay = 0.005
        async with dave.stream(question, max_tokens=150) as busy:
            with pytest.raises(TurnTimeoutError):
                await dave.ask(QUESTIONS[1], timeout=0.1)
            assert dave.statistics().queued == 0  # the timed-out request left the mailbox
            await busy.aclose()
        rt.faulty.delay = 0
        reply = await dave.ask(QUESTIONS[2])
        assert [m.content for m in dave.history] == [QUESTIONS[2], reply.text]


async def test_concurrent_asks_to_one_agent_are_served_in_order(
    tiny: Loaded, tiny_dir: Path
) -> None:
    async with runtime(tiny_dir) as rt:
        erin = await rt.spawn("erin", max_tokens=12)
        async with (
            erin.stream(QUESTIONS[0]) as s0,
            erin.stream(QUESTIONS[1]) as s1,
            erin.stream(QUESTIONS[2]) as s2,
        ):
            texts = {}
            for i, stream in reversed(list(enumerate([s0, s1, s2]))):
                texts[i] = "".join([piece async for piece in stream])
        assert [m.content for m in erin.history[::2]] == QUESTIONS[:3]
        assert [m.content for m in erin.history[1::2]] == [texts[0], texts[1], texts[2]]
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        for i, stream in enumerate([s0, s1, s2]):
            prompt = render(tiny.tokenizer, erin.history[: 2 * i + 1])
            assert list(stream.reply.tokens) == chat.turn(prompt, 12)
            assert stream.reply.text == texts[i]


async def test_a_full_mailbox_makes_senders_wait(tiny_dir: Path) -> None:
    async with runtime(tiny_dir) as rt:
        fay = await rt.spawn("fay", max_tokens=8, mailbox_size=1)
        done = []

        async def third() -> None:
            done.append(await fay.ask(QUESTIONS[2]))

        async with anyio.create_task_group() as tg:
            async with fay.stream(QUESTIONS[0], max_tokens=3000) as running:
                async with fay.stream(QUESTIONS[1]) as queued:
                    tg.start_soon(third)
                    await wait_all_tasks_blocked()
                    stats = fay.statistics()
                    assert (stats.queued, stats.senders_waiting) == (1, 1)
                    assert not done
                    await running.aclose()
                    text = "".join([piece async for piece in queued])
                    assert queued.reply.text == text
        assert len(done) == 1
        assert [m.content for m in fay.history[::2]] == QUESTIONS[1:3]


async def test_a_sender_waiting_on_a_closed_agents_mailbox_is_no_longer_expected(
    tiny_dir: Path,
) -> None:
    # An ask is announced to the scheduler as it is sent (an idle engine waits a moment
    # for announced turns); one that never reaches the mailbox must be taken back.
    async with runtime(tiny_dir) as rt:
        fay = await rt.spawn("fay", max_tokens=8, mailbox_size=1)
        errors: list[BaseException] = []

        async def ask(text: str) -> None:
            try:
                await fay.ask(text)
            except AgentClosedError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            async with fay.stream(QUESTIONS[0], max_tokens=3000) as running:
                await anext(running)
                tg.start_soon(ask, QUESTIONS[1])  # queued
                await wait_all_tasks_blocked()
                tg.start_soon(ask, QUESTIONS[2])  # waits for room in the mailbox
                await wait_all_tasks_blocked()
                assert fay.statistics().senders_waiting == 1
                await fay.close()
        assert len(errors) == 2
        assert rt._scheduler._coming.count == 0  # nothing announced is still expected


async def test_leaving_the_runtime_fails_waiting_callers_and_returns_every_block(
    tiny_dir: Path,
) -> None:
    outcomes: list[BaseException] = []
    first_piece = anyio.Event()

    async def ask(agent: Any, text: str) -> None:
        try:
            async with agent.stream(text, max_tokens=3000) as stream:
                async for _ in stream:
                    first_piece.set()
        except RuntimeClosedError as exc:
            outcomes.append(exc)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as callers:
            rt = runtime(tiny_dir)
            async with rt:
                agents = [await rt.spawn(f"agent{i}", mailbox_size=4) for i in range(3)]
                for agent in agents:
                    callers.start_soon(ask, agent, QUESTIONS[0])
                    callers.start_soon(ask, agent, QUESTIONS[1])  # waits in the mailbox
                await first_piece.wait()
    assert len(outcomes) == 6
    stats = await rt.stats()
    assert (stats.pool.used_blocks, stats.pool.reserved_blocks, stats.agents) == (0, 0, 0)
    with pytest.raises(RuntimeClosedError):
        await agents[0].ask("anyone?")
    with pytest.raises(RuntimeClosedError):
        await rt.spawn("late")


EXIT_SCRIPT = """
import sys, threading, anyio
from mlx_actors import Runtime

def engine_threads():
    return [t for t in threading.enumerate() if t.name == "mlx-actors-engine"]

async def main(path):
    for _ in range(3):
        async with Runtime(path, log_level="off") as rt:
            assert len(engine_threads()) == 1
            agent = await rt.spawn("a")
            await agent.ask("Tell me about the sea.", max_tokens=16)
        assert engine_threads() == [], engine_threads()
    print("clean")

anyio.run(main, sys.argv[1], backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_engine_thread_ends_with_the_runtime_and_the_process_exits_cleanly(
    tiny_dir: Path, backend: str
) -> None:
    # MLX state a thread leaves behind can abort the interpreter at exit (mlx#4327).
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tiny_dir), backend],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "clean"), done.stderr


THREAD_EXIT_SCRIPT = """
import ctypes, sys, threading, time
import anyio

path, backend, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

def hold_back_thread_end(seconds):
    # A C++ thread_local destructor registered now runs before those registered
    # earlier (MLX's, at import), so the thread's end waits until the interpreter is
    # finalising: what is otherwise a race happens every time. glibc only.
    try:
        libc = ctypes.CDLL(None)
        register = libc.__cxa_thread_atexit_impl
    except (OSError, AttributeError):
        return
    register.argtypes = [ctypes.c_void_p] * 3
    usleep = ctypes.cast(libc.usleep, ctypes.c_void_p)
    register(usleep, int(seconds * 1e6), usleep)

class SlowFinalisation:
    def __del__(self, sleep=time.sleep):
        sleep(1.0)  # the interpreter is finalising: an ending thread may take the GIL

def worker():
    from mlx_actors import Runtime  # the first import of mlx and mlx_lm, on this thread
    hold_back_thread_end(0.3)

    async def main():
        async with Runtime(path, pool_blocks=64, log_level="off") as rt:
            agent = await rt.spawn("a")
            await agent.ask("Tell me about the sea.", max_tokens=4)

    anyio.run(main, backend=backend)

assert "mlx.core" not in sys.modules
threads = [threading.Thread(target=worker) for _ in range(n)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
slow = SlowFinalisation()
print("clean")
"""


@pytest.mark.parametrize(("backend", "threads"), [("asyncio", 1), ("trio", 2)])
def test_a_runtime_in_a_thread_of_its_own_lets_the_process_exit_cleanly(
    tiny_dir: Path, backend: str, threads: int
) -> None:
    # Importing mlx-lm gives the importing thread an MLX random key whose destructor
    # takes the GIL; run at the thread's very end, it aborted an interpreter already
    # finalising ("terminate called without an active exception").
    done = subprocess.run(
        [sys.executable, "-c", THREAD_EXIT_SCRIPT, str(tiny_dir), backend, str(threads)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "clean"), done.stderr


async def test_an_engine_error_fails_its_turns_and_other_agents_keep_working(
    tiny: Loaded, tiny_dir: Path
) -> None:
    async with FaultyRuntime(tiny_dir, pool_blocks=400, log_level="off") as rt:
        gus = await rt.spawn("gus", max_tokens=20)
        hal = await rt.spawn("hal", max_tokens=20)
        await gus.ask(QUESTIONS[0])
        before = gus.history
        question = long_question(tiny, before)
        rt.faulty.fail_in = 10  # a pass in the middle of gus's turn (150 tokens) fails
        with pytest.raises(EngineError, match="injected fault"):
            async with gus.stream(question, max_tokens=150) as stream:
                async for _ in stream:
                    pass
        assert gus.history == before
        reply = await hal.ask(QUESTIONS[2])
        prompt = render(tiny.tokenizer, hal.history[:-1])
        assert list(reply.tokens) == reference(
            tiny.model, prompt, 20, stop=tiny.tokenizer.eos_token_ids
        )
        again = await gus.ask(QUESTIONS[3])
        assert again.usage.cached_tokens > 0
        stats = await rt.stats()
        assert stats.pool.used_blocks == await held_by_agents(rt)


async def test_reset_and_close(tiny_dir: Path) -> None:
    async with runtime(tiny_dir) as rt:
        ivy = await rt.spawn("ivy", system="You are Ivy.", max_tokens=10)
        await ivy.ask(QUESTIONS[0])
        assert ivy.statistics().cached_blocks > 0
        await ivy.reset()
        assert [m.role for m in ivy.history] == ["system"]
        assert ivy.statistics().cached_tokens == 0
        assert (await rt.stats()).pool.used_blocks == 0
        await ivy.ask(QUESTIONS[1])
        assert set(rt.agents) == {"ivy"} and rt.agent("ivy") is ivy
        await ivy.close()
        await ivy.close()  # closing twice is fine
        assert ivy.closed and "ivy" not in rt.agents
        with pytest.raises(AgentClosedError):
            await ivy.ask("still there?")
        with pytest.raises(UnknownAgentError):
            rt.agent("ivy")
        assert (await rt.stats()).pool.used_blocks == 0
        again = await rt.spawn("ivy")  # the name is free again
        assert again is not ivy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"text": ""}, "non-empty"),
        ({"text": "   "}, "non-empty"),
        ({"text": 42}, "non-empty"),
        ({"text": "hi", "max_tokens": 0}, "max_tokens"),
        ({"text": "hi", "max_tokens": -1}, "max_tokens"),
        ({"text": "hi", "timeout": 0}, "timeout"),
        ({"text": "hi", "temperature": -0.5}, "temperature"),
        ({"text": "hi", "top_p": 2}, "top_p"),
        ({"text": "hi", "stop": [""]}, "stop"),
    ],
)
async def test_bad_asks_get_typed_errors(
    tiny_dir: Path, kwargs: dict[str, Any], match: str
) -> None:
    async with runtime(tiny_dir) as rt:
        jay = await rt.spawn("jay", max_tokens=5)
        with pytest.raises(InvalidRequestError, match=match):
            await jay.ask(**kwargs)
        assert jay.history == () and jay.statistics().turns == 0
        await jay.ask("fine")


async def test_bad_spawns_get_typed_errors(tiny_dir: Path) -> None:
    async with runtime(tiny_dir) as rt:
        await rt.spawn("kim")
        for name in ["kim", "Kim", "KIM"]:  # names ignore case: they name files
            with pytest.raises(InvalidRequestError, match="already exists"):
                await rt.spawn(name)
        for name in ["", "../etc", "a/b", "x.y", "9lives", "a" * 65, None, "spa ce"]:
            with pytest.raises(InvalidRequestError, match="name"):
                await rt.spawn(name)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await rt.spawn("lee", max_tokens=0)
        with pytest.raises(InvalidRequestError, match="temperature"):
            await rt.spawn("lee", temperature=-1)
        assert set(rt.agents) == {"kim"}


async def test_a_prompt_longer_than_the_context_fails_only_that_turn(tiny_dir: Path) -> None:
    async with runtime(tiny_dir) as rt:
        max_ = await rt.spawn("max", max_tokens=5)
        with pytest.raises(ContextLengthError, match="context"):
            await max_.ask("x" * 5000)
        assert max_.history == ()
        await max_.ask("short")
        assert (await rt.stats()).pool.used_blocks == await held_by_agents(rt)
