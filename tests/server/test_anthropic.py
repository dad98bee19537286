"""The server's Messages API, driven by the real ``anthropic`` client on a real socket:
replies (whole and streamed, in Anthropic's event order) equal ``agent.ask``'s, the cache
is reported as read, and a tool_use round trip equals the agent's own tool round."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_actors.actors import as_tools

from ..conftest import Loaded, add
from .conftest import fetch, model, runtime, serving

pytestmark = pytest.mark.anyio

QUESTIONS = ["Hello there.", "Tell me more."]
USER = {"role": "user", "content": "Hello"}


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_equal_agent_ask_and_read_the_cache(tiny: Loaded, stream: bool) -> None:
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("reference", system="Be brief.", max_tokens=16)
        expected = [await agent.ask(q) for q in QUESTIONS]
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.anthropic
        messages: list[dict[str, Any]] = []
        for question, reference in zip(QUESTIONS, expected):
            messages.append({"role": "user", "content": [{"type": "text", "text": question}]})
            options: dict[str, Any] = dict(
                model=model(rt),
                max_tokens=16,
                system="Be brief.",
                messages=messages,
                metadata={"user_id": "ann"},
            )
            if stream:
                async with client.messages.stream(**options) as events:
                    kinds = [event.type async for event in events]
                    message = await events.get_final_message()
                assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
                assert kinds.index("content_block_start") < kinds.index("content_block_stop")
                assert kinds[-2] == "message_delta"
            else:
                message = await client.messages.create(**options)
            (block,) = message.content
            assert block.type == "text" and block.text == reference.text
            reason = {"stop": "end_turn", "length": "max_tokens"}[reference.finish_reason]
            assert message.stop_reason == reason
            assert message.usage.output_tokens == len(reference.tokens)
            assert message.usage.input_tokens == reference.usage.prompt_tokens
            assert message.usage.cache_read_input_tokens == reference.usage.cached_tokens
            messages.append({"role": "assistant", "content": block.text})


async def test_a_stop_sequence_is_named(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt:
        agent = await rt.spawn("reference", max_tokens=40)
        plain = await agent.ask("Hello there.")
    # a character first seen after the start of the reply: the reply stops before it
    at = next(i for i, c in enumerate(plain.text) if i and c.isascii() and c not in plain.text[:i])
    stop = plain.text[at]
    async with runtime(tiny.path) as rt, serving(rt) as server:
        message = await server.anthropic.messages.create(
            model=model(rt),
            max_tokens=40,
            messages=[{"role": "user", "content": "Hello there."}],
            stop_sequences=["\x00never", stop],
        )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].type == "text" and message.content[0].text == plain.text[:at]


async def test_a_tool_use_round_trip_equals_the_agents_own(tools_model: Loaded) -> None:
    question = "What is 2 + 3?"
    async with runtime(tools_model.path) as rt:
        inside = await rt.spawn("inside", tools=[add], max_tokens=120)
        own = await inside.ask(question, tool_choice="required")
    (ran,) = own.tool_calls
    spec = as_tools([add])[0]
    tool = {"name": "add", "description": spec.description, "input_schema": spec.parameters}
    async with runtime(tools_model.path) as rt, serving(rt) as server:
        client = server.anthropic
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        options: dict[str, Any] = dict(model=model(rt), max_tokens=120, tools=[tool])
        first = await client.messages.create(
            messages=messages, tool_choice={"type": "any"}, **options
        )
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "add" and use.input == dict(ran.arguments)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": str(ran.result)}
                ],
            },
        ]
        async with client.messages.stream(messages=messages, **options) as events:
            answer = await events.get_final_message()
    assert answer.content[0].type == "text" and answer.content[0].text == own.text
    held = first.usage.input_tokens + first.usage.output_tokens
    assert (answer.usage.cache_read_input_tokens or 0) >= held - 1  # only the result is new


@pytest.mark.parametrize(
    ("changes", "status", "match"),
    [
        ({"model": "claude-sonnet"}, 404, "not served here"),
        ({"max_tokens": None}, 400, "'max_tokens' is required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tool"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "I"},
                ]
            },
            400,
            "prefill",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "text",
        ),
        ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    ],
)
async def test_a_bad_request_gets_anthropics_error_shape(
    tiny: Loaded, changes: dict[str, Any], status: int, match: str
) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        body: dict[str, Any] = {
            "model": model(rt),
            "max_tokens": 4,
            "messages": [USER],
            **changes,
        }
        got, data = await fetch(
            f"{server.url}/v1/messages",
            "POST",
            json.dumps({k: v for k, v in body.items() if v is not None}).encode(),
            {"content-type": "application/json", "anthropic-version": "2023-06-01"},
        )
    error = json.loads(data)
    assert got == status and error["type"] == "error"
    assert error["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    assert match in error["error"]["message"]
