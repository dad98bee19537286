"""Fixtures of the server's tests: the server on a real listening socket beside a running
runtime (stopped gracefully when the block ends), on asyncio (uvicorn's loop)."""

from __future__ import annotations

import contextlib
import functools
import gc
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import attrs
import openai
import pytest

from mlx_actors import Runtime
from mlx_actors.server import listen, serve


def _no_close_on_collection(self: Any) -> None:
    """The SDKs' async clients, when collected unclosed, schedule their close on the
    event loop running then: in a later test, whose loop is not their connections'
    ("Event loop is closed", raised into that test). The tests close their clients;
    one collected unclosed is left to the garbage collector."""


for _sdk in (openai, anthropic):
    _sdk._base_client.AsyncHttpxClientWrapper.__del__ = _no_close_on_collection


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn's loop


def runtime(path: Path, **options: Any) -> Runtime:
    return Runtime(path, **{"pool_blocks": 300, "log_level": "off", **options})


def model(rt: Runtime) -> str:
    """The id the server gives the runtime's model."""
    return Path(str(rt.model_path)).name


@attrs.frozen
class Served:
    """A running server: its base URL, and clients of both APIs (closed with it)."""

    url: str
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic


@contextlib.asynccontextmanager
async def serving(rt: Runtime, *, key: str = "none", **options: Any) -> AsyncIterator[Served]:
    """The server while the block runs (its socket listens before this yields: a
    client may connect at once); ``key`` is the clients' API key."""
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(serve, rt, sock=sock, **options))
        try:
            async with (
                openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120
                ) as openai_client,
                anthropic.AsyncAnthropic(
                    base_url=url, api_key=key, max_retries=0, timeout=120
                ) as anthropic_client,
            ):
                yield Served(url, openai_client, anthropic_client)
        finally:
            gc.collect()  # what the block left unreachable goes with its own loop
            tg.cancel_scope.cancel()


async def fetch(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """A plain HTTP request (stdlib, on a worker thread): its status and body."""

    def call() -> tuple[int, bytes]:
        request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    return await anyio.to_thread.run_sync(call)
