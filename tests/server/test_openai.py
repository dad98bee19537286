"""The server's Chat Completions, driven by the real ``openai`` client on a real socket:
replies equal the same conversation through ``agent.ask``, a session's history comes
from its cache, tool calls go back to the client and come back with their results,
``response_format`` replies validate, and a client that leaves cancels its turn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from mlx_actors import Reply
from mlx_actors.actors import as_tools
from mlx_actors.server._sessions import session_agent

from ..conftest import Loaded, add
from .conftest import fetch, model, runtime, serving

pytestmark = pytest.mark.anyio

QUESTIONS = ["Hello there.", "Tell me more.", "And then?"]


ADD = as_tools([add])[0].spec()


async def asked(path: Path, questions: list[str], **settings: Any) -> list[Reply]:
    """The same dialogue through ``agent.ask``, in a runtime of its own."""
    async with runtime(path) as rt:
        agent = await rt.spawn("reference", system="Be brief.", **settings)
        return [await agent.ask(q) for q in questions]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_session_equals_agent_ask_and_reuses_its_cache(tiny: Loaded, stream: bool) -> None:
    expected = await asked(tiny.path, QUESTIONS, max_tokens=16)
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
        held = 0
        for question, reference in zip(QUESTIONS, expected):
            messages.append({"role": "user", "content": question})
            options: dict[str, Any] = dict(
                model=model(rt), messages=messages, max_tokens=16, prompt_cache_key="s1"
            )
            if stream:
                chunks = await client.chat.completions.create(
                    **options, stream=True, stream_options={"include_usage": True}
                )
                pieces, finish, usage = [], None, None
                async for chunk in chunks:
                    if chunk.choices:
                        pieces.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                    usage = chunk.usage or usage
                content = "".join(pieces)
            else:
                reply = await client.chat.completions.create(**options)
                content = reply.choices[0].message.content or ""
                finish, usage = reply.choices[0].finish_reason, reply.usage
            assert content == reference.text and finish == reference.finish_reason
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.completion_tokens == len(reference.tokens)
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= held  # the session's history came from its cache
            held = usage.prompt_tokens
            messages.append({"role": "assistant", "content": content})
        agent = rt.agents[session_agent("s1")]
        assert agent.statistics().turns == len(QUESTIONS)


async def test_an_edited_history_rewinds_to_where_it_parts(tiny: Loaded) -> None:
    edited = [QUESTIONS[0], "Something else entirely."]
    expected = await asked(tiny.path, edited, max_tokens=16)
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai

        async def turn(messages: list[dict[str, Any]]) -> Any:
            return await client.chat.completions.create(
                model=model(rt), messages=messages, max_tokens=16, user="ann"
            )

        system = {"role": "system", "content": "Be brief."}
        first = await turn([system, {"role": "user", "content": QUESTIONS[0]}])
        kept = [
            system,
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": first.choices[0].message.content},
        ]
        second = await turn([*kept, {"role": "user", "content": QUESTIONS[1]}])
        again = await turn([*kept, {"role": "user", "content": edited[1]}])
        assert again.choices[0].message.content == expected[1].text
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert second.usage is not None and first.usage is not None
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        stats = await rt.stats()
        assert stats.pool.used_blocks == sum(
            a.statistics().cached_blocks for a in rt.agents.values()
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_round_trip_equals_the_agents_own(
    tools_model: Loaded, stream: bool, tmp_path: Path
) -> None:
    question = "What is 2 + 3?"
    async with runtime(tools_model.path) as rt:
        inside = await rt.spawn("inside", tools=[add], max_tokens=120)
        own = await inside.ask(question, tool_choice="required")
    (ran,) = own.tool_calls
    assert ran.error is None
    trace = tmp_path / "trace.jsonl"
    async with runtime(tools_model.path, trace=trace) as rt, serving(rt) as server:
        client = server.openai
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        options: dict[str, Any] = dict(
            model=model(rt), tools=[ADD], max_tokens=120, prompt_cache_key="calc"
        )
        if stream:
            chunks = await client.chat.completions.create(
                messages=messages,
                tool_choice="required",
                stream=True,
                stream_options={"include_usage": True},
                **options,
            )
            content, calls, finish, usage = "", [], None, None
            async for chunk in chunks:
                usage = chunk.usage or usage
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    content += delta.content or ""
                    calls += delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
            (call,) = calls
            assert call.function is not None
            call_id, name, arguments = call.id, call.function.name, call.function.arguments
            assert content == ""  # the call's text is not shown as content
        else:
            first = await client.chat.completions.create(
                messages=messages, tool_choice="required", **options
            )
            finish, usage = first.choices[0].finish_reason, first.usage
            (made,) = first.choices[0].message.tool_calls or []
            call_id, name, arguments = made.id, made.function.name, made.function.arguments
            assert first.choices[0].message.content is None
        assert finish == "tool_calls" and name == "add" and call_id
        assert json.loads(arguments or "{}") == dict(ran.arguments)
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": str(ran.result)},
        ]
        answer = await client.chat.completions.create(messages=messages, **options)
        assert answer.choices[0].message.content == own.text
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        # the call's turn came from the cache: only the result and the next prompt are new
        assert usage is not None
        held = usage.prompt_tokens + usage.completion_tokens
        assert answer.usage.prompt_tokens_details.cached_tokens >= held - 1
    # while the client ran the tool, the session's cache was pinned in the pool
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    pins = [e for e in events if e["event"] == "agent.pinned"]
    assert [e["seconds"] for e in pins] == [60.0]


async def test_response_format_replies_validate(tiny: Loaded) -> None:
    schema = {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "calm"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["mood", "score"],
        "additionalProperties": False,
    }
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai
        messages = [{"role": "user", "content": "How do you feel?"}]
        reply = await client.chat.completions.create(
            model=model(rt),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=60,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "feeling", "schema": schema, "strict": True},
            },
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
        assert reply.choices[0].finish_reason == "stop"
        reply = await client.chat.completions.create(
            model=model(rt),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=60,
            response_format={"type": "json_object"},
            logit_bias={"125": 20},  # "}" (a byte of the tiny tokenizer): a short object
        )
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


async def test_logprobs_name_each_generated_token(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai
        reply = await client.chat.completions.create(
            model=model(rt),
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
        )
        agent = await rt.spawn("inside")
        own = await agent.ask("Hello", max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(own.tokens)
    assert [c.logprob for c in content] == pytest.approx(own.logprobs)
    assert own.top_logprobs is not None
    for entry, top in zip(content, own.top_logprobs):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in top])


async def test_a_client_that_leaves_cancels_its_turn(tiny: Loaded) -> None:
    eos = {str(t): -100 for t in tiny.tokenizer.eos_token_ids}
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai
        messages = [{"role": "user", "content": "Go on forever."}]
        chunks = await client.chat.completions.create(
            model=model(rt),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=3000,
            logit_bias=eos,  # it cannot end before the client leaves
            stream=True,
            prompt_cache_key="leaver",
        )
        async for _ in chunks:
            break
        await chunks.close()  # the connection drops mid-turn
        # Queued behind the first turn in the session's mailbox: it runs once that one
        # was cancelled (or, were the cancel lost, after 3,000 tokens).
        reply = await client.chat.completions.create(
            model=model(rt),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            prompt_cache_key="leaver",
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        agent = rt.agents[session_agent("leaver")]
        assert agent.statistics().turns == 1  # the cancelled turn was undone
        stats = await rt.stats()
        assert stats.pool.used_blocks == agent.statistics().cached_blocks
        status, metrics = await fetch(f"{server.url}/metrics")
    assert status == 200
    assert b'mlx_actors_cancelled_turns_total{api="openai"} 1.0' in metrics


@pytest.mark.parametrize(
    ("changes", "status", "code", "match"),
    [
        ({"model": "gpt-5"}, 404, "model_not_found", "not served here"),
        ({"messages": []}, 400, None, "must not be empty"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, None, "role"),
        ({"n": 2}, 400, None, "'n' must be 1"),
        ({"audio": {"voice": "x"}}, 400, None, "not supported"),
        ({"temperature": "hot"}, 400, None, "must be a number"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            400,
            None,
            "schema",
        ),
        ({"tool_choice": "required"}, 400, None, "needs tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, "text"),
        (
            {"messages": [{"role": "user", "content": "x" * 5000}]},
            400,
            "context_length_exceeded",
            "context",
        ),
    ],
)
async def test_a_bad_request_gets_the_apis_error_and_status(
    tiny: Loaded, changes: dict[str, Any], status: int, code: str | None, match: str
) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        client = server.openai
        body: dict[str, Any] = {
            "model": model(rt),
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            **changes,
        }
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(**body)
        assert info.value.status_code == status
        assert info.value.code == code and match in info.value.message
        assert not rt.agents or all(a.history == () for a in rt.agents.values())
