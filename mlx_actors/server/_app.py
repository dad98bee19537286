"""The ASGI app: routes, the API key, body limits, and each request run as its session's
turn while the client is watched (a client that leaves cancels the turn)."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..actors import Agent, Reply
from ..actors._tool_format import tool_format
from ..errors import InvalidRequestError
from ..runtime import Expected, Runtime
from . import _anthropic as anthropic
from . import _fields as f
from . import _openai as openai
from ._chat import Chat, Shown, ShownText, shown
from ._errors import ApiError, api_error
from ._metrics import Metrics
from ._sessions import Sessions, check_session

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Answer(Protocol):
    """One API's way of writing a turn's reply, whole or as a stream of events."""

    api: str

    async def body(self, reply: Reply, shown: Shown) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    def text(self, piece: str) -> list[bytes]: ...

    async def closing(self, reply: Reply, shown: Shown) -> list[bytes]: ...

    def failure(self, exc: ApiError) -> list[bytes]: ...

    def error(self, exc: ApiError) -> dict[str, Any]: ...


class Writer:
    """The response's side of ``send``: headers once, then the body."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def start(self, status: int, media_type: str) -> None:
        self.started = True
        headers = [(b"content-type", media_type.encode()), (b"cache-control", b"no-cache")]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def json(self, status: int, body: dict[str, Any]) -> None:
        await self.start(status, "application/json")
        await self.write([json.dumps(body, ensure_ascii=False).encode()])
        await self.end()


class Exchange:
    """A response that runs a turn while it watches the client: one that leaves (or
    whose connection drops) cancels the turn at once, not at the next write, and the
    agent undoes it. ``expected`` (the request counted as a turn on its way since it
    arrived) is closed when it ends, if its turn did not take its place."""

    def __init__(self, run: Callable[[Writer], Awaitable[None]], expected: Expected) -> None:
        self._run = run
        self._expected = expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await self._run(Writer(send))
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            # The server cancelled the request (its grace after Ctrl-C ran out): the
            # turn is undone; the request ends here rather than as an error in its log.
            return
        finally:
            self._expected.close()


class Server:
    """The endpoints over one running runtime; see :func:`create_app`."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        api_key: str | None,
        model_name: str | None,
        max_sessions: int,
        session_idle_timeout: float | None,
        request_timeout: float | None,
        max_body_bytes: int,
        max_tokens: int,
        tool_pin_seconds: float = 60.0,
    ) -> None:
        if runtime.tokenizer is None:
            raise InvalidRequestError(
                "create_app needs a running runtime: call it inside `async with Runtime(...)`"
            )
        self.runtime = runtime
        self.form = tool_format(runtime.tokenizer)
        self.sessions = Sessions(
            runtime, self.form, max_sessions=max_sessions, idle_timeout=session_idle_timeout
        )
        self.metrics = Metrics(runtime, self.sessions)
        self.model = model_name or Path(str(runtime.model_path)).name
        self.created = int(time.time())
        self._key = api_key.encode() if api_key else None
        self._timeout = request_timeout
        self._tool_pin = tool_pin_seconds
        self._max_body = max_body_bytes
        self._max_tokens = max_tokens
        self._log = runtime.log
        self._ignored: set[str] = set()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model_info, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # -- the turns ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Any:
        expected = None
        try:
            expected = self._expect(request)
            body = await self._body(request)
            parsed = openai.parse(body, session=_session(request), max_tokens=self._max_tokens)
            self._check_model(parsed.model)
            self._note_ignored(openai.ignored(body))
        except Exception as exc:
            if expected is not None:
                expected.close()
            return self._refusal(exc, "openai", openai.error)
        answer = openai.Answer(parsed, self.runtime.token_texts)
        return Exchange(lambda writer: self._turn(parsed.chat, answer, writer), expected)

    async def messages(self, request: Request) -> Any:
        expected = None
        try:
            expected = self._expect(request)
            body = await self._body(request)
            parsed = anthropic.parse(body, session=_session(request))
            self._check_model(parsed.model)
            self._note_ignored(anthropic.ignored(body))
        except Exception as exc:
            if expected is not None:
                expected.close()
            return self._refusal(exc, "anthropic", anthropic.error)
        answer = anthropic.Answer(parsed.model)
        return Exchange(lambda writer: self._turn(parsed.chat, answer, writer), expected)

    def _expect(self, request: Request) -> Expected:
        """An authorized request is a turn on its way from now (its body still coming,
        then parsed and rendered): the engine, if idle, waits for it within its
        admission window, so requests sent together start in one batch."""
        self._authorize(request)
        return self.runtime.expect()

    async def _turn(self, chat: Chat, answer: Answer, writer: Writer) -> None:
        """Answer ``chat`` as its session's turn; any failure as the API's error."""
        self.metrics.in_flight.inc()
        status = 200
        try:
            async with self.sessions.agent_for(chat) as agent:
                if chat.stream:
                    await self._stream(agent, chat, answer, writer)
                else:
                    reply = await agent.respond(
                        chat.conversation,
                        system=chat.system,
                        tools=chat.tools,
                        schema=chat.schema,
                        timeout=self._timeout,
                        **chat.settings,
                    )
                    seen = shown(reply, self.form, chat)
                    self._pin_for_tools(agent, seen)
                    self.metrics.replied(answer.api, reply, seen.finish_reason)
                    await writer.json(200, await answer.body(reply, seen))
        except anyio.get_cancelled_exc_class():
            status = 499  # the client left: the turn was undone
            self.metrics.cancelled.labels(answer.api).inc()
            raise
        except Exception as exc:
            error = self._api_error(exc)
            status = error.status
            if not writer.started:
                await writer.json(error.status, answer.error(error))
            else:  # mid-stream: the API's error event, then the end
                await writer.write(answer.failure(error))
                await writer.end()
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(answer.api, str(status)).inc()

    async def _stream(self, agent: Agent, chat: Chat, answer: Answer, writer: Writer) -> None:
        """The reply as events; the first is sent with the first text (or the end), so
        that a turn refused before it (a full pool, a context too long) is an error
        status rather than an event."""
        choice = chat.settings.get("tool_choice")
        marker = self.form.start if chat.tools and choice != "none" else None
        text = ShownText(marker)
        pieces = agent.respond_stream(
            chat.conversation,
            system=chat.system,
            tools=chat.tools,
            schema=chat.schema,
            timeout=self._timeout,
            **chat.settings,
        )
        async with pieces:
            async for piece in pieces:
                if not writer.started:
                    await writer.start(200, "text/event-stream")
                    await writer.write(answer.opening())
                if new := text.feed(piece):
                    await writer.write(answer.text(new))
            reply = pieces.reply
        seen = shown(reply, self.form, chat)
        self._pin_for_tools(agent, seen)
        if not writer.started:
            await writer.start(200, "text/event-stream")
            await writer.write(answer.opening())
        if rest := text.finish(bool(seen.calls)):
            await writer.write(answer.text(rest))
        self.metrics.replied(answer.api, reply, seen.finish_reason)
        await writer.write(await answer.closing(reply, seen))
        await writer.end()

    def _pin_for_tools(self, agent: Agent, seen: Shown) -> None:
        """A reply that calls tools: its client runs them and comes back with the
        results, so the session's cache stays in the pool meanwhile (for a while)."""
        if seen.calls and self._tool_pin > 0:
            agent.pin(self._tool_pin)

    # -- the rest ---------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return JSONResponse(openai.error(exc), exc.status)
        entry = self._model_entry()
        return JSONResponse(
            {
                "object": "list",
                "data": [entry],
                "has_more": False,
                "first_id": self.model,
                "last_id": self.model,
            }
        )

    async def model_info(self, request: Request) -> Response:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except ApiError as exc:
            return JSONResponse(openai.error(exc), exc.status)
        return JSONResponse(self._model_entry())

    def _model_entry(self) -> dict[str, Any]:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "mlx-actors",
            "type": "model",
            "display_name": self.model,
            "created_at": created,
        }

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model})

    async def prometheus(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return JSONResponse(openai.error(exc), exc.status)
        return Response(
            await self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        error = ApiError(404, f"no such endpoint: {request.method} {request.url.path}")
        error.kind = "not_found_error"
        return JSONResponse(openai.error(error), 404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        error = ApiError(405, f"{request.url.path} does not take {request.method}")
        return JSONResponse(openai.error(error), 405)

    def _authorize(self, request: Request) -> None:
        """With an API key: refuse a request that does not carry it (compared in
        constant time), as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
        if self._key is None:
            return
        given = request.headers.get("x-api-key")
        bearer = request.headers.get("authorization", "")
        if given is None and bearer[:7].lower() == "bearer ":
            given = bearer[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), self._key):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                kind="authentication_error",
            )

    async def _body(self, request: Request) -> dict[str, Any]:
        """The request's JSON body (its key checked before); no bigger than the limit."""
        too_big = ApiError(
            413,
            f"the request body is larger than {self._max_body:,} bytes (--max-body-bytes)",
            kind="request_too_large",
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise too_big
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body:
                raise too_big
            chunks.append(chunk)
        return f.loads(b"".join(chunks))

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(
                404,
                f"the model {model!r} is not served here; this server serves {self.model!r}",
                kind="not_found_error",
                param="model",
                code="model_not_found",
            )

    def _note_ignored(self, names: list[str]) -> None:
        new = [n for n in names if n not in self._ignored]
        if new:
            self._ignored.update(new)
            self._log.warning("server.ignored_fields", fields=new)

    def _api_error(self, exc: Exception) -> ApiError:
        error = api_error(exc)
        if error is None:
            self._log.exception("server.internal_error", error=repr(exc))
            error = ApiError(500, "internal error: see the server's log", kind="api_error")
        return error

    def _refusal(
        self, exc: Exception, api: str, render: Callable[[ApiError], dict[str, Any]]
    ) -> Response:
        error = self._api_error(exc)
        self.metrics.requests.labels(api, str(error.status)).inc()
        return JSONResponse(render(error), error.status)


def _session(request: Request) -> str | None:
    header = request.headers.get("x-session-id")
    return None if header is None else check_session(header, "X-Session-Id")


def create_app(
    runtime: Runtime,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    max_sessions: int = 256,
    session_idle_timeout: float | None = None,
    request_timeout: float | None = None,
    max_body_bytes: int = 16 << 20,
    max_tokens: int = 2048,
    tool_pin_seconds: float = 60.0,
) -> Starlette:
    """An ASGI app serving ``runtime`` (entered: inside ``async with Runtime()``) over
    OpenAI's Chat Completions and Anthropic's Messages APIs, each session an agent.

    Run it with any ASGI server on the runtime's event loop (asyncio), for instance
    ``await uvicorn.Server(uvicorn.Config(app)).serve()`` inside the ``async with``.

    Raises:
        InvalidRequestError: the runtime is not running, or an option is out of range.

    Args:
        api_key: if set, every request but ``GET /health`` must carry it.
        model_name: the model's id for clients (default: its directory's name).
        max_sessions: most sessions kept; beyond it the least recently used idle one
            is closed (its agent and what a state directory kept of it).
        session_idle_timeout: seconds after which an idle session is closed (``None``:
            only the limit closes sessions).
        request_timeout: seconds a turn may take, queueing included (``None``: no limit).
        max_body_bytes: the largest request body taken.
        max_tokens: the reply's length when a Chat Completions request does not say.
        tool_pin_seconds: after a reply that calls tools, the session's cache is kept
            in the pool this long while the client runs them (unpinned agents' caches
            leave first; 0: no pin).
    """
    for name, value in (
        ("max_sessions", max_sessions),
        ("max_body_bytes", max_body_bytes),
        ("max_tokens", max_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
    if (
        isinstance(tool_pin_seconds, bool)
        or not isinstance(tool_pin_seconds, (int, float))
        or not 0 <= tool_pin_seconds < float("inf")
    ):
        raise InvalidRequestError(
            f"tool_pin_seconds must be seconds >= 0, got {tool_pin_seconds!r}"
        )
    return Server(
        runtime,
        api_key=api_key,
        model_name=model_name,
        max_sessions=max_sessions,
        session_idle_timeout=session_idle_timeout,
        request_timeout=request_timeout,
        max_body_bytes=max_body_bytes,
        max_tokens=max_tokens,
        tool_pin_seconds=float(tool_pin_seconds),
    ).app()
