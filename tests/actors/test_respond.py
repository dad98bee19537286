"""``Agent.respond``: a conversation its caller keeps (an HTTP client's copy) answered as
mlx-lm answers it, reusing the agent's cache as far as the two agree; tool calls come
back to the caller, and a round trip through the caller equals the in-process one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_actors import Message, Runtime, ToolCall
from mlx_actors.actors import as_tools
from mlx_actors.actors._tool_format import tool_format
from mlx_actors.errors import InvalidRequestError

from ..conftest import EACH_TOOL_FORMAT_ON_ONE_LOOP, Loaded, ReferenceChat, add, reference, render
from .test_agents import common_prefix

pytestmark = pytest.mark.anyio


#: ``add`` as a caller describes it: no function here.
ADD = attrs.evolve(as_tools([add])[0], function=None, arguments_model=None)


def runtime(path: Path, **options: Any) -> Runtime:
    return Runtime(path, **{"pool_blocks": 300, "log_level": "off", **options})


def user(text: str) -> Message:
    return Message(role="user", content=text)


def assistant(text: str, calls: tuple[ToolCall, ...] = ()) -> Message:
    return Message(role="assistant", content=text, tool_calls=calls)


async def test_a_callers_conversation_is_answered_as_mlx_lm_and_only_new_tokens_prefilled(
    tiny: Loaded,
) -> None:
    chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
    system = Message(role="system", content="Be brief.")
    conversation: list[Message] = []
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("session")
        held = 0
        for question in ["Hello there.", "Tell me more.", "And then?"]:
            conversation.append(user(question))
            reply = await agent.respond(conversation, system="Be brief.", max_tokens=16)
            prompt = render(tiny.tokenizer, [system, *conversation])
            assert list(reply.tokens) == chat.turn(prompt, 16)
            assert reply.usage.cached_tokens >= held  # the history came from the cache
            assert reply.usage.cached_tokens + reply.usage.prompt_tokens == len(prompt)
            held = len(prompt)
            conversation.append(assistant(reply.text))
        assert agent.history == (system, *conversation)
        assert agent.system == "Be brief."


async def test_an_edited_history_goes_back_to_where_it_parts(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("session")
        first = await agent.respond([user("Hello there.")], max_tokens=12)
        kept = [user("Hello there."), assistant(first.text)]
        more = [*kept, user("Tell me more.")]
        second = await agent.respond(more, max_tokens=12)
        edited = [*kept, user("Something else entirely.")]
        reply = await agent.respond(edited, max_tokens=12)
        prompt = render(tiny.tokenizer, edited)
        expected = reference(tiny.model, prompt, 12, stop=tiny.tokenizer.eos_token_ids)
        assert list(reply.tokens) == expected
        held = [*render(tiny.tokenizer, more), *second.tokens]
        assert reply.usage.cached_tokens == common_prefix(held, prompt) > len(prompt) // 2
        assert agent.history == (*edited, assistant(reply.text))
        # a trimmed one too
        reply = await agent.respond([user("Hello there.")], max_tokens=12)
        assert reply.tokens == first.tokens and reply.usage.prompt_tokens <= 1
        stats = await rt.stats()
        assert stats.pool.used_blocks == agent.statistics().cached_blocks


@EACH_TOOL_FORMAT_ON_ONE_LOOP
async def test_a_tool_round_through_the_caller_equals_the_agents_own(
    tools_model: Loaded,
) -> None:
    """The calls come back unrun; the caller's results, sent with the reply as it was
    shown, prefill only the results, and the answer equals an in-process tool round's."""
    form = tool_format(tools_model.tokenizer)
    async with runtime(tools_model.path) as rt:
        inside = await rt.spawn("inside", tools=[add], max_tokens=120)
        own = await inside.ask("What is 2 + 3?", tool_choice="required")
        (ran,) = own.tool_calls

        caller = await rt.spawn("caller", max_tokens=120)
        question = [user("What is 2 + 3?")]
        first = await caller.respond(question, tools=[ADD], tool_choice="required")
        assert first.finish_reason == "tool_calls" and first.tool_calls == ()
        (call,) = first.pending_calls
        assert (call.name, dict(call.arguments)) == (ran.name, dict(ran.arguments))
        before = form.before_calls(first.text)
        assert form.written(before, first.pending_calls) == first.text
        shown = assistant(before, first.pending_calls)
        result = Message(role="tool", content=str(ran.result), name="add", tool_call_id=call.id)
        second = await caller.respond([*question, shown, result], tools=[ADD])
        assert second.tokens == own.tokens
        held = first.usage.cached_tokens + first.usage.prompt_tokens + len(first.tokens)
        assert second.usage.cached_tokens >= held - 1  # only the result was prefilled
        assert caller.history[1].content == first.text  # kept as the model wrote it


@EACH_TOOL_FORMAT_ON_ONE_LOOP
async def test_calls_written_by_the_caller_render_as_the_model_writes_them(
    tools_model: Loaded,
) -> None:
    """A conversation whose calls the agent never made (another process made them):
    rendered as mlx-lm renders the model's own, so the reply equals mlx-lm's."""
    form = tool_format(tools_model.tokenizer)
    call = ToolCall(id="abc123XYZ", name="add", arguments={"a": 2, "b": 3})
    conversation = [
        user("What is 2 + 3?"),
        assistant("", (call,)),
        Message(role="tool", content="5", name="add", tool_call_id=call.id),
    ]
    async with runtime(tools_model.path) as rt:
        agent = await rt.spawn("caller")
        reply = await agent.respond(conversation, tools=[ADD], max_tokens=20)
    written = conversation[1]
    if not form.native:
        written = assistant(form.written("", (call,)), (call,))
    messages, extra = form.conversation(None, [conversation[0], written, conversation[2]], [ADD])
    prompt = tools_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, **extra
    )
    eos = tools_model.tokenizer.eos_token_ids
    assert list(reply.tokens) == reference(tools_model.model, prompt, 20, stop=eos)


async def test_a_cancelled_respond_leaves_the_agent_as_it_was(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("session", system="Old.")
        await agent.respond([user("Hello there.")], system="Old.", max_tokens=8)
        history, cached = agent.history, agent.cached_tokens
        used = (await rt.stats()).pool.used_blocks
        eos = tiny.tokenizer.eos_token_ids
        async with agent.respond_stream(
            [user("Something long.")],
            system="New.",
            tools=[ADD],
            max_tokens=3000,
            logit_bias={t: -100.0 for t in eos},
        ) as pieces:
            async for _ in pieces:
                break  # leaving the stream mid-turn cancels it
        assert agent.history == history and agent.system == "Old."
        assert agent.tools == () and agent.cached_tokens == cached
        assert (await rt.stats()).pool.used_blocks == used


async def test_a_schema_reply_cut_short_has_no_data_and_no_error(tiny: Loaded) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    }
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("session")
        reply = await agent.respond([user("Name?")], schema=schema, max_tokens=3)
        assert reply.finish_reason == "length" and reply.data is None
        assert reply.text.startswith("{")


@pytest.mark.parametrize(
    ("conversation", "match"),
    [
        ([], "empty"),
        ("Hello", "list of Messages"),
        ([user("Hi"), assistant("Hello")], "ends with a message of role 'assistant'"),
        ([Message(role="robot", content="Hi")], "role 'robot'"),
        ([user("\ud800")], "lone surrogate"),
        (["Hi"], "not a Message"),
    ],
)
async def test_a_malformed_conversation_is_refused(
    tiny: Loaded, conversation: Any, match: str
) -> None:
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("session")
        with pytest.raises(InvalidRequestError, match=match):
            await agent.respond(conversation)
        with pytest.raises(InvalidRequestError, match="needs tools"):
            await agent.respond([user("Hi")], tool_choice="required")
        assert agent.history == ()
