"""Tools: schemas derived from functions, calls parsed in the model's format, and the
agent's loop (run the calls, give the results back, let the model answer), on tiny
random-weight models whose first reply a constraint makes a call. The answer after the
results is compared with mlx-lm's own greedy generation on the whole conversation."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Literal

import anyio
import jsonschema
import pydantic
import pytest

from mlx_actors import Message, Runtime, Tool, tool
from mlx_actors.actors import as_tools
from mlx_actors.actors._tool_format import tool_format
from mlx_actors.errors import InvalidRequestError, TurnTimeoutError

from ..conftest import EACH_TOOL_FORMAT_ON_ONE_LOOP, Loaded, load, reference

CALLS: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    CALLS.append((a, b))
    return a + b


@pytest.fixture
def model(tools_model: Loaded) -> Loaded:
    """A model with a tools template, and one whose template knows nothing of tools."""
    return tools_model


def final_prompt(model: Loaded, agent: Any, upto: int) -> list[int]:
    """The conversation's first ``upto`` messages rendered as mlx-lm would render them."""
    messages = [m for m in agent.history if m.role != "system"][:upto]
    conversation, extra = tool_format(model.tokenizer).conversation(
        agent.system, messages, agent.tools
    )
    return list(
        model.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **extra)
    )


# -- what a tool is --------------------------------------------------------------------------


class Point(pydantic.BaseModel):
    x: float
    y: float


def test_schemas_come_from_signatures_hints_and_docstrings() -> None:
    (made,) = as_tools([add])
    assert made.name == "add" and made.description == "Add two integers."
    assert made.parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first."},
            "b": {"type": "integer", "description": "the second."},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }

    def plot(points: list[Point], kind: Literal["line", "bar"] = "line", title: str | None = None):  # type: ignore[no-untyped-def]
        """Draw points."""

    schema = as_tools([plot])[0].parameters
    assert schema["required"] == ["points"]
    assert schema["properties"]["kind"] == {
        "enum": ["line", "bar"],
        "type": "string",
        "default": "line",
    }
    assert schema["properties"]["points"]["items"] == {"$ref": "#/$defs/Point"}
    jsonschema.validate({"points": [{"x": 1, "y": 2}], "kind": "bar"}, schema)

    explicit = tool(name="sum", description="Sum.", parameters={"type": "object"})(sum)
    assert isinstance(explicit, Tool) and explicit.arguments_model is None
    assert explicit.spec()["function"]["name"] == "sum"

    def spread(*numbers: int) -> int:
        return 0

    for bad in ([spread], [add, add], add, ["add"]):
        with pytest.raises(InvalidRequestError):
            as_tools(bad)  # type: ignore[arg-type]


def test_calls_are_read_from_text_in_order(tiny: Loaded) -> None:
    fmt = tool_format(tiny.tokenizer)
    assert not fmt.native and fmt.json_calls
    text = (
        'Let me see. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{not json</tool_call>"
    )
    first, second, broken = fmt.calls(text, "c", as_tools([add]))
    assert (first.name, dict(first.arguments)) == ("add", {"a": 1, "b": 2})
    assert (second.name, dict(second.arguments)) == ("add", {"a": 3, "b": 4})
    assert broken.error is not None and "could not be read" in broken.error
    assert fmt.before_calls(text) == "Let me see."
    assert fmt.calls("no calls here", "c", ()) == ()


# -- the loop --------------------------------------------------------------------------------


@EACH_TOOL_FORMAT_ON_ONE_LOOP
@pytest.mark.anyio
async def test_a_required_call_runs_and_its_result_reaches_the_model(model: Loaded) -> None:
    CALLS.clear()
    async with Runtime(model.path, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", system="Use the tools.", tools=[add], max_tokens=120)
        reply = await agent.ask("What is 2 + 3?", tool_choice="required")
        (call,) = reply.tool_calls
        assert call.name == "add" and call.error is None
        assert [(call.arguments["a"], call.arguments["b"])] == CALLS
        assert call.result == call.arguments["a"] + call.arguments["b"]
        roles = [m.role for m in agent.history]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        assert agent.history[2].tool_calls[0].name == "add"
        assert agent.history[3].content == str(call.result)
        # The answer is mlx-lm's own continuation of the conversation with the result.
        prompt = final_prompt(model, agent, 3)
        eos = model.tokenizer.eos_token_ids
        assert list(reply.tokens) == reference(model.model, prompt, 120, stop=eos)
        assert reply.finish_reason in ("stop", "length")
        # Only new tokens were prefilled: the call the model wrote (and its end token)
        # came from the cache when the result was added.
        written = len(agent.history[2].content.encode()) + 1
        assert reply.usage.prompt_tokens == len(prompt) - written
        # The next turn goes on from there.
        again = await agent.ask("And 4 + 4?", tool_choice="add")
        assert [c.name for c in again.tool_calls] == ["add"] and len(CALLS) == 2


@pytest.mark.anyio
async def test_errors_become_messages_the_model_reads(tiny_dir: Path) -> None:
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    def unserialisable() -> object:
        """Return something odd."""
        return object()

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[divide, unserialisable], max_tokens=120)
        divide_reply = await agent.ask("1/0?", tool_choice="divide", logit_bias={ord("0"): 50})
        (call,) = divide_reply.tool_calls
        assert call.arguments["b"] == 0 and call.result is None
        assert call.error == "divide raised ZeroDivisionError: division by zero"
        assert agent.history[2].content == f"Error: {call.error}"  # user, call, result
        odd = await agent.ask("Something odd?", tool_choice="unserialisable")
        assert "not JSON" in (odd.tool_calls[0].error or "")
        assert len(agent.history) == 8  # both turns kept, each with its call and result


class Looked(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    x: int

    @pydantic.field_validator("x")
    @classmethod
    def look_up(cls, value: int) -> int:
        return {0: value}[-1]  # a KeyError, which pydantic lets through


@pytest.mark.anyio
async def test_whatever_a_tool_raises_or_returns_the_model_is_told(
    tiny_dir: Path, anyio_backend: str
) -> None:
    def looked_up(arg: Looked) -> str:
        """Take an argument whose validator fails."""
        return "never"

    def deep() -> list[Any]:
        """Return a value nested deeper than JSON can write."""
        value: list[Any] = []
        for _ in range(5000):
            value = [value]
        return value

    async def interrupted() -> str:
        """Fail with a BaseException of its own: on asyncio, awaiting a future that was
        cancelled elsewhere (not a cancel of the turn); on trio, GeneratorExit."""
        if anyio_backend == "asyncio":
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            return str(await future)
        raise GeneratorExit

    def infinite() -> dict[str, float]:
        """Return a number JSON cannot write."""
        return {"x": float("inf")}

    def garbled() -> str:
        """Return text with a lone surrogate, as a bad decode leaves it."""
        return "caf\udce9"

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        tools = [looked_up, deep, infinite, interrupted, garbled]
        agent = await rt.spawn("t", tools=tools, max_tokens=120)
        expected = {
            "looked_up": "bad arguments for looked_up: -1",
            "deep": "deep returned list, which is not JSON",
            "infinite": "infinite returned dict, which is not JSON: Out of range float",
            "interrupted": "interrupted raised "
            + ("CancelledError" if anyio_backend == "asyncio" else "GeneratorExit"),
        }
        for turn, (name, error) in enumerate(expected.items(), 1):
            reply = await agent.ask("Go.", tool_choice=name)
            (call,) = reply.tool_calls
            assert (call.error or "").startswith(error), call.error
            assert len(agent.history) == 4 * turn  # kept: user, call, result, answer
        reply = await agent.ask("Go.", tool_choice="garbled")  # was a TypeError
        assert reply.tool_calls[0].result == "caf\udce9"  # as returned; the model reads:
        assert agent.history[-2].content == "caf\ufffd"
        assert not agent.closed and list(rt.agents) == ["t"]
        assert (await agent.ask("Still there?")).tool_calls == ()


@pytest.mark.anyio
async def test_a_tool_cannot_send_a_request_to_an_agent_that_waits_for_it(
    tiny_dir: Path,
) -> None:
    agents: dict[str, Any] = {}

    async def ask_myself() -> str:
        """Ask myself."""
        return (await agents["a"].ask("Again?")).text

    def fork_myself_from_a_thread() -> str:
        """Fork myself."""
        return str(anyio.from_thread.run(agents["a"].fork, "a2").name)

    async def ask_b() -> str:
        """Ask b, whose tool asks a."""
        reply = await agents["b"].ask("And you?", tool_choice="ask_a")
        return reply.tool_calls[0].error or "b's tool ran"

    async def ask_a() -> str:
        """Ask a."""
        return (await agents["a"].ask("Back to you.")).text

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        tools = [ask_myself, fork_myself_from_a_thread, ask_b]
        agents["a"] = await rt.spawn("a", tools=tools, max_tokens=120)
        agents["b"] = await rt.spawn("b", tools=[ask_a], max_tokens=120)
        with anyio.fail_after(120):  # a deadlock fails here rather than hang the run
            for name in ("ask_myself", "fork_myself_from_a_thread"):
                reply = await agents["a"].ask("Go.", tool_choice=name)
                assert "would wait for itself" in (reply.tool_calls[0].error or "")
            reply = await agents["a"].ask("Go.", tool_choice="ask_b")
            assert "('a' -> 'b' -> 'a')" in str(reply.tool_calls[0].result)
            assert reply.tool_calls[0].error is None  # b answered a's tool
        assert set(rt.agents) == {"a", "b"}


@pytest.mark.anyio
async def test_a_task_a_tool_starts_may_ask_its_agent_once_the_turn_is_over(
    tiny_dir: Path,
) -> None:
    turn_over = anyio.Event()
    answers: list[Any] = []
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        async with anyio.create_task_group() as tg:

            async def later() -> None:
                await turn_over.wait()
                answers.append(await agent.ask("Now?"))

            async def schedule() -> str:
                """Ask me again once this turn is over."""
                tg.start_soon(later)  # the task starts with this tool's context
                return "scheduled"

            agent = await rt.spawn("a", tools=[schedule], max_tokens=120)
            await agent.ask("Go.", tool_choice="schedule")
            turn_over.set()
    assert len(answers) == 1 and answers[0].tokens


@pytest.mark.anyio
async def test_sync_tools_run_on_a_worker_thread_and_async_ones_on_the_loop(
    tiny_dir: Path,
) -> None:
    seen: dict[str, bool] = {}
    loop_thread = threading.get_ident()

    def where_sync() -> str:
        """Where am I?"""
        seen["sync"] = threading.get_ident() == loop_thread
        return "here"

    async def where_async() -> str:
        """Where am I?"""
        seen["async"] = threading.get_ident() == loop_thread
        return "there"

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("w", tools=[where_sync, where_async], max_tokens=120)
        await agent.ask("Sync?", tool_choice="where_sync")
        await agent.ask("Async?", tool_choice="where_async")
    assert seen == {"sync": False, "async": True}


@pytest.mark.anyio
async def test_a_slow_tool_times_out_and_the_turn_is_undone(tiny_dir: Path) -> None:
    release = threading.Event()

    def slow_sync() -> str:
        """Take a long time."""
        release.wait(timeout=60)
        return "late"

    never = anyio.Event()

    async def slow_async() -> str:
        """Take forever."""
        await never.wait()
        return "never"

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("slow", tools=[slow_sync, slow_async], max_tokens=120)
        await agent.ask("Warm up.")
        before = (agent.history, agent.cached_tokens, (await rt.stats()).pool.used_blocks)
        try:
            for name in ("slow_sync", "slow_async"):
                with pytest.raises(TurnTimeoutError):
                    await agent.ask("Wait.", tool_choice=name, timeout=0.5)
                after = (agent.history, agent.cached_tokens, (await rt.stats()).pool.used_blocks)
                assert after == before
        finally:
            release.set()
        reply = await agent.ask("Still there?")  # the agent goes on as before
        assert reply.tool_calls == () and len(agent.history) == 4


@pytest.mark.anyio
async def test_a_cancelled_tool_turn_leaves_the_agent_as_it_was(tiny_dir: Path) -> None:
    started = anyio.Event()

    async def wait() -> str:
        """Wait."""
        started.set()
        await anyio.sleep_forever()
        return ""

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("c", tools=[wait], max_tokens=120)
        used = (await rt.stats()).pool.used_blocks
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: agent.ask("Go.", tool_choice="required"))
            await started.wait()
            tg.cancel_scope.cancel()
        assert agent.history == () and agent.cached_tokens == 0
        assert (await rt.stats()).pool.used_blocks == used


#: Tools that end things: an interrupt or an exit raised by a tool's own code (async and
#: sync), and the runtime closed from inside the turn. Run in a process of its own: on
#: asyncio, a KeyboardInterrupt let out of a task ends the event loop; a close that
#: waited for its own turn hung the process.
ENDING_TOOLS = textwrap.dedent(
    """
    import json, sys
    import anyio
    from mlx_actors import Runtime

    async def main(model, state, backend):
        async with Runtime(model, pool_blocks=100, log_level="off", state_dir=state) as rt:
            async def interrupt() -> str:
                \"\"\"Interrupt.\"\"\"
                raise KeyboardInterrupt

            def leave() -> str:
                \"\"\"Exit.\"\"\"
                raise SystemExit(3)

            async def close() -> str:
                \"\"\"Close the runtime.\"\"\"
                await rt.aclose()
                return "closed"

            agent = await rt.spawn("t", tools=[interrupt, leave], max_tokens=120)
            closer = await rt.spawn("c", tools=[close], max_tokens=120)
            for name in ("interrupt", "leave"):
                reply = await agent.ask("Go.", tool_choice=name)
                print(json.dumps({"call": name, "error": reply.tool_calls[0].error}))
            try:
                with anyio.fail_after(60):
                    await closer.ask("Go.", tool_choice="close")
            except Exception as exc:
                print(json.dumps({"close": type(exc).__name__}))
            print(json.dumps({"after": [m.role for m in agent.history]}))
        print(json.dumps({"left": True}))

    anyio.run(main, *sys.argv[1:4], backend=sys.argv[3])
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_tool_that_interrupts_exits_or_closes_the_runtime_ends_only_its_call(
    tiny_dir: Path, tmp_path: Path, backend: str
) -> None:
    state = tmp_path / "state"
    args = [sys.executable, "-c", ENDING_TOOLS, str(tiny_dir), str(state), backend]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines == [
        {"call": "interrupt", "error": "interrupt raised KeyboardInterrupt"},
        {"call": "leave", "error": "leave raised SystemExit: 3"},
        {"close": "RuntimeClosedError"},  # the closing turn fails, typed
        {"after": ["user", "assistant", "tool", "assistant"] * 2},
        {"left": True},
    ]

    async def reopened() -> dict[str, list[str]]:
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
            return {name: [m.role for m in a.history] for name, a in rt.agents.items()}

    # nothing lost: the answered turns kept, the closing one undone
    assert anyio.run(reopened) == {"t": ["user", "assistant", "tool", "assistant"] * 2, "c": []}


@pytest.mark.anyio
async def test_max_tool_rounds_ends_the_turn_with_the_calls_not_run(tiny_dir: Path) -> None:
    CALLS.clear()
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[add], max_tokens=120, max_tool_rounds=0)
        reply = await agent.ask("2 + 3?", tool_choice="required")
        assert reply.finish_reason == "tool_calls" and reply.tool_calls == ()
        assert CALLS == []
        assert agent.history[-1].tool_calls[0].name == "add"
        with pytest.raises(InvalidRequestError, match="tool_choice"):
            await agent.ask("2 + 3?", tool_choice="multiply")
        plain = await rt.spawn("plain")
        with pytest.raises(InvalidRequestError, match="needs tools"):
            await plain.ask("2 + 3?", tool_choice="required")


@EACH_TOOL_FORMAT_ON_ONE_LOOP
@pytest.mark.anyio
async def test_a_schema_reply_after_tool_calls(model: Loaded) -> None:
    class Answer(pydantic.BaseModel):
        value: int

    async with Runtime(model.path, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[add], max_tokens=120)
        # After the required call, the reply may be a call or the answer: the bias on
        # "<" makes this model answer.
        reply = await agent.ask(
            "2 + 3?", tool_choice="required", schema=Answer, logit_bias={ord("<"): -30}
        )
        assert [c.name for c in reply.tool_calls] == ["add"]
        assert isinstance(reply.data, Answer)
        assert reply.data == Answer.model_validate_json(reply.text)


@pytest.mark.anyio
async def test_an_answer_that_mentions_a_call_is_an_answer(tiny_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"note": {"enum": ["write <tool_call> first"]}},
        "required": ["note"],
        "additionalProperties": False,
    }
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[add], max_tokens=60)
        # The grammar allows a call or the answer; the bias on "<" makes it the answer.
        reply = await agent.ask("Note?", schema=schema, logit_bias={ord("<"): -100})
        assert reply.data == {"note": "write <tool_call> first"}
        assert reply.tool_calls == () and reply.finish_reason != "tool_calls"
        assert [m.role for m in agent.history] == ["user", "assistant"]


@pytest.mark.anyio
async def test_tool_turns_stream_every_round(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[add], max_tokens=120)
        async with agent.stream("2 + 3?", tool_choice="required") as pieces:
            text = "".join([piece async for piece in pieces])
        call_text = agent.history[1].content
        assert text == call_text + pieces.reply.text
        assert json.loads(call_text.split("\n")[1])["name"] == "add"


@EACH_TOOL_FORMAT_ON_ONE_LOOP
@pytest.mark.anyio
async def test_a_tool_conversation_survives_a_restart(model: Loaded, tmp_path: Path) -> None:
    async with Runtime(model.path, pool_blocks=200, log_level="off", state_dir=tmp_path) as rt:
        agent = await rt.spawn("calc", system="Use the tools.", tools=[add], max_tokens=120)
        await agent.ask("What is 2 + 3?", tool_choice="required")
        history = agent.history
    async with Runtime(model.path, pool_blocks=200, log_level="off", state_dir=tmp_path) as rt:
        agent = rt.agent("calc")
        assert agent.history == history
        assert [t.name for t in agent.tools] == ["add"] and agent.tools[0].function is None
        failed = await agent.ask("Again?", tool_choice="add")  # no function in this process
        assert "no function" in (failed.tool_calls[0].error or "")
        agent.use_tools([add])
        reply = await agent.ask("And 4 + 4?")
        prompt = final_prompt(model, agent, len(agent.history) - 2)
        eos = model.tokenizer.eos_token_ids
        assert list(reply.tokens) == reference(model.model, prompt, 120, stop=eos)
        assert reply.usage.cached_tokens > 0


@EACH_TOOL_FORMAT_ON_ONE_LOOP
@pytest.mark.anyio
async def test_a_tool_conversation_is_evicted_and_comes_back_exactly(model: Loaded) -> None:
    async with Runtime(model.path, pool_blocks=20, log_level="off") as rt:
        agent = await rt.spawn("calc", tools=[add], max_tokens=120)
        other = await rt.spawn("other", tools=[add], max_tokens=120)
        await agent.ask("What is 2 + 3?", tool_choice="required")
        await other.ask("What is 5 + 8?", tool_choice="required")  # pushes calc out
        assert agent.statistics().on_disk
        reply = await agent.ask("And 4 + 4?")
        stats = await rt.stats()
        assert stats.evictions >= 1 and stats.restores >= 1
        prompt = final_prompt(model, agent, len(agent.history) - 1)
        eos = model.tokenizer.eos_token_ids
        assert list(reply.tokens) == reference(model.model, prompt, 120, stop=eos)
        assert reply.usage.cached_tokens > 0


@pytest.mark.anyio
@pytest.mark.parametrize("then", ["answer", "cancel"])
async def test_an_agent_waiting_on_its_tool_leaves_a_full_pool_and_comes_back_exactly(
    tiny_dir: Path, then: str
) -> None:
    """While its tool runs, an agent holds its cache and the one its turn started from. A
    turn that needs that room, when no other cache can leave, evicts it (rather than
    being refused); the agent's next round brings its cache back, and its reply is
    mlx-lm's own. Cancelled after that, the agent is as it was before the turn."""
    model = load(tiny_dir)
    inside, gate = anyio.Event(), anyio.Event()

    async def look_up() -> str:
        """Look the answer up."""
        inside.set()
        await gate.wait()
        return "42"

    layers = model.spec.num_layers
    async with Runtime(tiny_dir, pool_blocks=12 * layers, log_level="off") as rt:
        calc = await rt.spawn("calc", tools=[look_up], max_tokens=120)
        await calc.ask("Hello " * 30, tool_choice="none")
        before = calc.history
        other = await rt.spawn("other", max_tokens=8)
        replies: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def ask() -> None:
                replies.append(await calc.ask("What is it?", tool_choice="look_up"))

            tg.start_soon(ask)
            with anyio.fail_after(30):  # a hang fails the test instead of stalling the suite
                await inside.wait()  # its first round is over; both its caches are held
            assert (await rt.stats()).pool.used_blocks >= 4 * layers  # calc's two caches
            # A prompt that needs 11 of the pool's 12 blocks per layer: calc must leave.
            await other.ask(text_of(model, 10 * 256), timeout=30)
            assert calc.statistics().on_disk
            if then == "cancel":
                tg.cancel_scope.cancel()
            else:
                gate.set()
        stats = await rt.stats()
        assert stats.evictions >= 1 and stats.turns_in_flight == 0
        if then == "answer":
            (reply,) = replies
            assert stats.restores >= 1 and [c.name for c in reply.tool_calls] == ["look_up"]
            prompt = final_prompt(model, calc, len(calc.history) - 1)
            eos = model.tokenizer.eos_token_ids
            assert list(reply.tokens) == reference(model.model, prompt, 120, stop=eos)
        else:  # as before the turn: the next one answers the same conversation
            assert calc.history == before and replies == []
            reply = await calc.ask("And now?", tool_choice="none")
            prompt = final_prompt(model, calc, len(calc.history) - 1)
            eos = model.tokenizer.eos_token_ids
            assert list(reply.tokens) == reference(model.model, prompt, 120, stop=eos)
        agents = (calc, other)
        assert stats.pool.used_blocks <= sum(a.statistics().cached_blocks for a in agents)


def text_of(model: Loaded, tokens: int) -> str:
    """Words that tokenise to at least ``tokens`` tokens."""
    rng = random.Random(tokens)
    words: list[str] = []
    while len(model.tokenizer.encode(" ".join(words))) < tokens:
        words.extend("".join(rng.choices("abcdefghijklmnop", k=5)) for _ in range(64))
    return " ".join(words)


# -- found in review ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_agents_between_tool_rounds_never_make_others_wait_forever(tiny_dir: Path) -> None:
    """Two agents in a round of calls at once, in a pool with room for one more round:
    the one that finds no room is refused at once (nothing it could wait for is in the
    engine), the other finishes; nothing hangs and every block comes back."""
    both = anyio.Event()
    waiting: list[str] = []

    async def meet(who: str) -> str:
        """Wait for the other agent."""
        waiting.append(who)
        if len(waiting) == 2:
            both.set()
        await both.wait()
        return "met"

    async with Runtime(tiny_dir, pool_blocks=14, log_level="off") as rt:
        agents = [await rt.spawn(n, tools=[meet], max_tokens=120) for n in ("a", "b")]
        outcomes: dict[str, str] = {}

        async def go(agent: Any) -> None:
            try:
                await agent.ask("Meet?", tool_choice="meet")
                outcomes[agent.name] = "ok"
            except Exception as exc:
                outcomes[agent.name] = type(exc).__name__

        with anyio.fail_after(60):  # a hang fails the test instead of stalling the suite
            async with anyio.create_task_group() as tg:
                for agent in agents:
                    tg.start_soon(go, agent)
        assert sorted(outcomes.values()) in (
            ["PoolExhaustedError"] * 2,
            ["PoolExhaustedError", "ok"],
        )
        stats = await rt.stats()
        assert stats.turns_in_flight == 0
        assert stats.pool.used_blocks == sum(a.statistics().cached_blocks for a in agents)


def test_call_ids_are_nine_letters_and_digits(tiny: Loaded) -> None:
    calls = tool_format(tiny.tokenizer).calls(
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>' * 3, ("a", 0, 0), ()
    )
    assert len({c.id for c in calls}) == 3
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_a_cut_call_is_not_shown_as_a_call_the_model_never_made(native_dir: Path) -> None:
    fmt = tool_format(load(native_dir).tokenizer)
    assert fmt.native
    text = '<tool_call>\n{"name": "add", "a'
    message = Message(role="assistant", content=text, tool_calls=fmt.calls(text, "k", ()))
    assert message.tool_calls[0].error is not None
    conversation, _ = fmt.conversation(None, [message], as_tools([add]))
    assert conversation == [{"role": "assistant", "content": text}]


@pytest.mark.anyio
async def test_tool_arguments_with_models_and_the_choice_checked_everywhere(tiny_dir: Path) -> None:
    drawn: list[list[Point]] = []

    def draw(points: list[Point]) -> int:
        """Draw points."""
        drawn.append(points)
        return len(points)

    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        agent = await rt.spawn("d", tools=[draw], max_tokens=200)
        reply = await agent.ask("Draw.", tool_choice="required")  # the $defs resolve
        assert reply.tool_calls[0].error is None
        assert all(isinstance(p, Point) for p in drawn[0])
        for bad in ({"tool_choice": "add"}, {"tool_choice": " "}, {"tool_choice": "required"}):
            with pytest.raises(InvalidRequestError):
                await rt.spawn("bad", **bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            await agent.fork("child", tool_choice="add")
        picky = await rt.spawn("p", tools=[draw], tool_choice="draw")
        with pytest.raises(InvalidRequestError):
            picky.use_tools([add])  # its default choice names a tool it would lose


@EACH_TOOL_FORMAT_ON_ONE_LOOP
@pytest.mark.anyio
async def test_a_call_that_could_not_be_read_stays_unread_after_a_restart(
    model: Loaded, tmp_path: Path
) -> None:
    """A forced call cut by ``max_tokens``: it could not be read, so the model is shown
    the text it wrote. Before, a restart lost the call's error and showed the model a
    call of ``""`` it never made, and the next reply differed."""

    async def next_reply(restart: bool) -> tuple[Any, tuple[Any, ...]]:
        state = tmp_path / f"state-{restart}"
        options: dict[str, Any] = dict(pool_blocks=200, log_level="off", state_dir=state)
        async with Runtime(model.path, **options) as rt:
            agent = await rt.spawn("calc", tools=[add], max_tokens=8)
            await agent.ask("What is 2 + 3?", tool_choice="add", max_tool_rounds=0, max_tokens=20)
            (call,) = agent.history[1].tool_calls
            assert call.error is not None and "could not be read" in call.error
            if not restart:
                return await agent.ask("Next?"), agent.history
        async with Runtime(model.path, **options) as rt:
            agent = rt.agent("calc")
            assert agent.history[1].tool_calls == (call,)
            return await agent.ask("Next?"), agent.history

    plain, history = await next_reply(restart=False)
    restarted, restarted_history = await next_reply(restart=True)
    assert restarted_history == history
    assert restarted.tokens == plain.tokens
    assert restarted.usage.cached_tokens == plain.usage.cached_tokens
