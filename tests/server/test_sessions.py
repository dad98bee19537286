"""The server's sessions and edges: a stateless client reuses as much as a named session,
sessions share nothing when told, are limited, expire, and survive a restart warm; API
keys, body limits, metrics and the ``serve`` command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from mlx_actors import Runtime
from mlx_actors._cli import choose_attention
from mlx_actors.errors import InvalidRequestError
from mlx_actors.server import create_app
from mlx_actors.server._sessions import session_agent

from ..conftest import Loaded
from .conftest import fetch, model, runtime, serving

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant. " * 12
QUESTIONS = ["Hello there.", "Tell me more.", "And then?"]
HELLO: list[Any] = [{"role": "user", "content": "Hi."}]


async def dialogue(client: openai.AsyncOpenAI, rt: Runtime, **naming: Any) -> list[Any]:
    """The questions asked in turn, each request carrying the whole conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = await client.chat.completions.create(
            model=model(rt), messages=messages, max_tokens=12, **naming
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        replies.append(reply)
    return replies


def cached(reply: Any) -> int:
    return int(reply.usage.prompt_tokens_details.cached_tokens)


async def test_a_stateless_client_reuses_what_a_named_session_does(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        named = await dialogue(server.openai, rt, prompt_cache_key="named")
    async with runtime(tiny.path) as rt, serving(rt) as server:
        anonymous = await dialogue(server.openai, rt)
        other = await server.openai.chat.completions.create(
            model=model(rt), messages=[{"role": "user", "content": "Unrelated."}], max_tokens=4
        )
        assert len(rt.agents) == 2  # the dialogue's agent, and one for the other request
    assert [r.choices[0].message.content for r in anonymous] == [
        r.choices[0].message.content for r in named
    ]
    assert sum(map(cached, anonymous)) >= 0.9 * sum(map(cached, named)) > 0
    assert cached(other) <= 1  # "<|im_start|>" at most


async def test_sessions_share_nothing_when_told(tiny: Loaded) -> None:
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    for share in (True, False):
        async with runtime(tiny.path, share_prefixes=share) as rt, serving(rt) as server:
            replies = [
                await server.openai.chat.completions.create(
                    model=model(rt), messages=question, max_tokens=4, user=user
                )
                for user in ("ann", "bob")
            ]
            anonymous = await server.openai.chat.completions.create(
                model=model(rt), messages=question, max_tokens=4
            )
            # without sharing, a request with no session has an agent of its own, closed after
            assert len(rt.agents) == (3 if share else 2)
        assert (cached(replies[1]) > 0) == share  # bob's turn read ann's blocks
        assert (cached(anonymous) > 0) == share
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


async def test_sessions_beyond_the_limit_or_idle_too_long_are_closed(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt, max_sessions=2) as server:
        for user in ("a", "b", "c"):
            await server.openai.chat.completions.create(
                model=model(rt),
                messages=[{"role": "user", "content": "Hi."}],
                max_tokens=2,
                user=user,
            )
        assert set(rt.agents) == {session_agent("b"), session_agent("c")}
    async with runtime(tiny.path) as rt, serving(rt, session_idle_timeout=1e-6) as server:
        for user in ("a", "b"):
            await server.openai.chat.completions.create(
                model=model(rt),
                messages=[{"role": "user", "content": "Hi."}],
                max_tokens=2,
                user=user,
            )
        assert set(rt.agents) == {session_agent("b")}  # "a" was idle when "b" came


async def test_a_session_survives_a_restart_warm(tiny: Loaded, tmp_path: Path) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        expected = await dialogue(server.openai, rt, user="kept")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    state = tmp_path / "state"
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        async with runtime(tiny.path, state_dir=state) as rt, serving(rt) as server:
            reply = await server.openai.chat.completions.create(
                model=model(rt), messages=messages, max_tokens=12, user="kept"
            )
        assert reply.choices[0].message.content == expected[i].choices[0].message.content
        assert cached(reply) == cached(expected[i])  # the cache came back from the disk
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


@pytest.mark.parametrize("shared", [False, True])
async def test_concurrent_requests_are_each_answered_as_alone(tiny: Loaded, shared: bool) -> None:
    """Requests of several sessions batch; those of one session wait in its mailbox and
    are answered in turn, never interleaved."""
    questions = [f"Question number {i}?" for i in range(4)]
    async with runtime(tiny.path) as rt:
        expected = []
        for i, question in enumerate(questions):
            agent = await rt.spawn(f"ref{i}", max_tokens=12)
            expected.append((await agent.ask(question)).text)
    async with runtime(tiny.path) as rt, serving(rt) as server:
        got: dict[int, str] = {}

        async def ask(i: int) -> None:
            reply = await server.openai.chat.completions.create(
                model=model(rt),
                messages=[{"role": "user", "content": questions[i]}],
                max_tokens=12,
                extra_headers={"X-Session-Id": "shared" if shared else f"s{i}"},
            )
            got[i] = reply.choices[0].message.content or ""

        async with anyio.create_task_group() as tg:
            for i in range(len(questions)):
                tg.start_soon(ask, i)
        if shared:
            assert rt.agents[session_agent("shared")].statistics().turns == len(questions)
        else:
            assert len(rt.agents) == len(questions)
    assert [got[i] for i in range(len(questions))] == expected


async def test_an_api_key_is_required_when_set(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt, key="sekret", api_key="sekret") as server:
        reply = await server.openai.chat.completions.create(
            model=model(rt), messages=HELLO, max_tokens=2
        )
        assert reply.choices[0].finish_reason == "length"
        message = await server.anthropic.messages.create(  # as x-api-key
            model=model(rt), messages=HELLO, max_tokens=2
        )
        assert message.stop_reason == "max_tokens"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "sekre"}):
            status, body = await fetch(f"{server.url}/v1/models", headers=headers)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _ = await fetch(f"{server.url}/metrics")
        assert status == 401
        status, body = await fetch(f"{server.url}/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, body = await fetch(
            f"{server.url}/v1/models", headers={"Authorization": "Bearer sekret"}
        )
        assert status == 200 and json.loads(body)["data"][0]["id"] == model(rt)


async def test_bodies_over_the_limit_and_unknown_paths_are_refused(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt, max_body_bytes=1000) as server:
        body = {"model": model(rt), "messages": [{"role": "user", "content": "x" * 2000}]}
        status, data = await fetch(
            f"{server.url}/v1/chat/completions", "POST", json.dumps(body).encode()
        )
        assert status == 413 and "1,000 bytes" in json.loads(data)["error"]["message"]
        status, data = await fetch(f"{server.url}/v1/chat/completions", "POST", b"{not json")
        assert status == 400 and "not JSON" in json.loads(data)["error"]["message"]
        status, data = await fetch(f"{server.url}/v1/completions", "POST", b"{}")
        assert status == 404 and json.loads(data)["error"]["type"] == "invalid_request_error"
        assert not rt.agents
        assert rt._scheduler._coming.count == 0  # no refused request is still expected


async def test_a_request_still_arriving_holds_back_one_sent_after_it(tiny: Loaded) -> None:
    """A request counts as a turn on its way from its headers on: a request sent whole
    while the first one's body is still arriving waits for it (within the admission
    window) instead of starting alone, and the two start as one batch."""
    async with runtime(tiny.path, admission_window=1.0) as rt, serving(rt) as server:
        coming = rt._scheduler._coming
        slow_ask = [{"role": "user", "content": "Slow?"}]
        body = json.dumps({"model": model(rt), "messages": slow_ask, "max_tokens": 1}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()

        async def until(count: int, agents: int) -> None:
            """Until ``count`` turns are on their way and ``agents`` sessions have begun
            (a state that lasts: a count passing through a value may be missed)."""
            with anyio.fail_after(60):
                while True:
                    if (coming.count, len(rt.agents)) == (count, agents):
                        return
                    await anyio.sleep(0.001)

        async def ask() -> None:
            reply = await server.openai.chat.completions.create(
                model=model(rt), messages=HELLO, max_tokens=1
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 1

        async with await anyio.connect_tcp(host, int(port)) as slow:
            await slow.send(head + body[:10])
            await until(1, 0)  # the first request, its body not whole yet
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                # The second one came (2 on their way), began its session and was handed
                # to the engine (1 again: the first's, whose session has not begun).
                await until(1, 1)
                await slow.send(body[10:])
                answer = b""
                with contextlib.suppress(anyio.EndOfStream):  # the whole response
                    while True:
                        answer += await slow.receive()
        assert answer.startswith(b"HTTP/1.1 200")
        assert (await rt.stats()).max_batch_size == 2  # the two decoded together
        assert coming.count == 0


async def test_metrics_count_turns_tokens_and_sessions(tiny: Loaded) -> None:
    async with runtime(tiny.path) as rt, serving(rt) as server:
        replies = await dialogue(server.openai, rt, user="m")
        status, text = await fetch(f"{server.url}/metrics")
        stats = await rt.stats()
    assert status == 200
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.decode().splitlines()
        if line and not line.startswith("#")
    }
    assert values['mlx_actors_requests_total{api="openai",status="200"}'] == len(QUESTIONS)
    assert (
        values["mlx_actors_generated_tokens_total"]
        == stats.generated_tokens
        == sum(r.usage.completion_tokens for r in replies)
    )
    assert values["mlx_actors_prompt_tokens_reused_total"] == sum(map(cached, replies))
    assert values["mlx_actors_sessions"] == 1
    assert values["mlx_actors_time_to_first_token_seconds_count"] == len(QUESTIONS)
    assert values["mlx_actors_pool_blocks_used"] == stats.pool.used_blocks > 0


def test_the_serve_command_serves_and_stops_on_ctrl_c(tiny: Loaded) -> None:
    command = [sys.executable, "-m", "mlx_actors", "serve", str(tiny.path), "--port", "0"]
    process = subprocess.Popen(
        [*command, "--pool-blocks", "100"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # printed once the model is loaded
        assert line.startswith("mlx-actors: serving"), line
        url = line.split(" at ")[1].strip()
        status, body = anyio.run(fetch, f"{url}/health")
        assert status == 200 and json.loads(body)["model"] == tiny.path.name
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, rest
    assert rest.strip().endswith("mlx-actors: stopped") and "Traceback" not in rest


@pytest.mark.parametrize(
    ("flag", "environment", "expected"),
    [(False, None, "0"), (False, "1", "1"), (True, None, None)],
)
def test_the_server_turns_cudnn_attention_off_unless_told(
    monkeypatch: pytest.MonkeyPatch, flag: bool, environment: str | None, expected: str | None
) -> None:
    monkeypatch.delenv("MLX_CUDA_USE_CUDNN_SDPA", raising=False)
    if environment is not None:
        monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", environment)
    choose_attention(cudnn=flag)
    assert os.environ.get("MLX_CUDA_USE_CUDNN_SDPA") == expected


def test_serving_beyond_this_machine_needs_a_key() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mlx_actors", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--api-key" in done.stderr


def test_create_app_needs_a_running_runtime(tiny: Loaded) -> None:
    with pytest.raises(InvalidRequestError, match="running runtime"):
        create_app(runtime(tiny.path))
