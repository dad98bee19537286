"""OpenAI's Chat Completions (``POST /v1/chat/completions``): a request's body as a
:class:`Chat`, and the reply as a ``chat.completion`` or a stream of
``chat.completion.chunk`` events."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from ..actors import Message, Reply, Tool, ToolCall, check_parameters, check_tool_name
from . import _fields as f
from ._chat import Chat, Shown
from ._errors import ApiError

#: Fields a request may carry that change nothing here.
IGNORED = frozenset(
    {"store", "metadata", "service_tier", "safety_identifier", "user", "prompt_cache_key"}
)

UNSUPPORTED = {
    "audio": "this server writes text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "this server does not search the web",
    "functions": "use 'tools' (the legacy 'functions' are not supported)",
    "function_call": "use 'tool_choice' (the legacy 'function_call' is not supported)",
}

KNOWN = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "n",
        "modalities",
        "reasoning_effort",
        *IGNORED,
        *UNSUPPORTED,
    }
)


@attrs.frozen(kw_only=True)
class Request:
    """A Chat Completions request: the turn, and how to answer it."""

    chat: Chat
    model: str
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def parse(body: Mapping[str, Any], *, session: str | None, max_tokens: int) -> Request:
    """The request in ``body`` (``session``: the one the ``X-Session-Id`` header names;
    ``max_tokens``: the server's default)."""
    model = f.text(body, "model", required=True)
    assert model is not None
    f.unsupported(body, UNSUPPORTED)
    n = f.integer(body, "n", low=1)
    if n not in (None, 1):
        raise ApiError(400, "'n' must be 1: one reply per request", param="n")
    modalities = f.array(body, "modalities")
    if any(m != "text" for m in modalities):
        raise ApiError(400, "'modalities' may only be ['text'] here", param="modalities")
    system, conversation = _messages(f.array(body, "messages", required=True))
    tools = tuple(_tool(t, i) for i, t in enumerate(f.array(body, "tools")))
    settings: dict[str, Any] = {"max_tokens": _max_tokens(body) or max_tokens}
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
        settings[name] = f.number(body, name)
    settings["repetition_penalty"] = f.number(body, "repetition_penalty")
    settings["top_k"] = f.integer(body, "top_k", low=0)
    settings["seed"] = f.integer(body, "seed", low=0)
    settings["stop"] = f.stops(body.get("stop"), "stop")
    settings["logit_bias"] = _logit_bias(f.mapping(body, "logit_bias"))
    settings["tool_choice"] = _tool_choice(body.get("tool_choice"))
    logprobs = bool(f.flag(body, "logprobs"))
    top = f.integer(body, "top_logprobs", low=0) or 0
    if top and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    settings["logprobs"] = logprobs or None
    settings["top_logprobs"] = top or None
    options = f.mapping(body, "stream_options") or {}
    for name in ("prompt_cache_key", "user"):
        named = f.text(body, name)
        session = session if session is not None or not named else named
    chat = Chat(
        conversation=conversation,
        system=system,
        tools=tools,
        settings={k: v for k, v in settings.items() if v is not None},
        schema=_schema(f.mapping(body, "response_format")),
        stream=bool(f.flag(body, "stream")),
        session=session,
        parallel_calls=f.flag(body, "parallel_tool_calls") is not False,
    )
    return Request(
        chat=chat,
        model=model,
        include_usage=bool(f.flag(options, "include_usage")),
        logprobs=logprobs,
        top_logprobs=top,
    )


def ignored(body: Mapping[str, Any]) -> list[str]:
    """Fields of ``body`` this server does not know (they are ignored)."""
    return sorted(k for k in body if k not in KNOWN)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = f.integer(body, name, low=1)
        if value is not None:
            return value
    return None


def _messages(messages: list[Any]) -> tuple[str | None, tuple[Message, ...]]:
    """The leading system (or developer) messages, joined, and the conversation."""
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    system: list[str] = []
    conversation: list[Message] = []
    names: dict[str, str] = {}  # call id -> the tool's name, for its result
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        m = f.entry(raw, where)
        role = m.get("role")
        content = _content(m.get("content"), where)
        if role in ("system", "developer"):
            if conversation:
                conversation.append(Message(role="system", content=content))
            else:
                system.append(content)
        elif role == "user":
            conversation.append(Message(role="user", content=content))
        elif role == "assistant":
            calls = tuple(
                _call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(f.array(m, "tool_calls"))
            )
            names.update((c.id, c.name) for c in calls)
            conversation.append(Message(role="assistant", content=content, tool_calls=calls))
        elif role == "tool":
            call_id = f.text(m, "tool_call_id", required=True)
            assert call_id is not None
            name = names.get(call_id)
            conversation.append(
                Message(role="tool", content=content, name=name, tool_call_id=call_id)
            )
        else:
            raise ApiError(
                400,
                f"{where}.role must be 'system', 'developer', 'user', 'assistant' or 'tool', "
                f"got {role!r}",
                param=f"{where}.role",
            )
    if not conversation:
        raise ApiError(400, "'messages' holds no user message to answer", param="messages")
    return ("\n\n".join(system) if system else None), tuple(conversation)


def _content(content: object, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of parts")
    texts = []
    for j, raw in enumerate(content):
        part = f.entry(raw, f"{where}.content[{j}]")
        kind = part.get("type")
        if kind not in ("text", "refusal"):
            raise ApiError(
                400,
                f"{where}.content[{j}] is of type {kind!r}: this model reads text only",
                param=f"{where}.content",
            )
        value = f.text(part, kind, required=True)
        assert value is not None
        texts.append(value)
    return "\n".join(texts)


def _call(raw: object, where: str) -> ToolCall:
    call = f.entry(raw, where)
    function = f.entry(call.get("function"), f"{where}.function")
    call_id = f.text(call, "id", required=True)
    name = f.text(function, "name", required=True)
    arguments = f.text(function, "arguments") or "{}"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(
            400, f"{where}.function.arguments must be a JSON object", param=f"{where}.function"
        )
    assert call_id is not None and name is not None
    return ToolCall(id=call_id, name=name, arguments=parsed)


def _tool(raw: object, i: int) -> Tool:
    where = f"tools[{i}]"
    tool = f.entry(raw, where)
    if tool.get("type", "function") != "function":
        raise ApiError(400, f"{where}.type must be 'function'", param=where)
    function = f.entry(tool.get("function"), f"{where}.function")
    name = check_tool_name(function.get("name"))
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return Tool(
        name=name,
        description=f.text(function, "description") or "",
        parameters=check_parameters(name, parameters),
    )


def _tool_choice(choice: object) -> str | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = f.entry(choice.get("function"), "tool_choice.function")
        return f.text(function, "name", required=True)
    raise ApiError(
        400,
        "'tool_choice' must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _schema(response_format: Mapping[str, Any] | None) -> Any:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = f.entry(response_format.get("json_schema"), "response_format.json_schema")
        schema = f.mapping(spec, "schema")
        return schema if schema is not None else {}
    raise ApiError(
        400,
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
        param="response_format",
    )


def _logit_bias(bias: Mapping[str, Any] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, "'logit_bias' keys must be token ids", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, "'logit_bias' values must be numbers", param="logit_bias")
        out[token] = float(value)
    return out


# -- the reply ------------------------------------------------------------------------------


def usage(reply: Reply) -> dict[str, Any]:
    used = reply.usage
    prompt = used.prompt_tokens + used.cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": used.generated_tokens,
        "total_tokens": prompt + used.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": used.cached_tokens},
    }


def calls(shown: Shown) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": json.dumps(dict(c.arguments), ensure_ascii=False),
            },
        }
        for c in shown.calls
    ]


def logprobs(reply: Reply, texts: Mapping[int, str], top: int) -> dict[str, Any] | None:
    """The reply's ``logprobs.content`` (``texts``: each token id's text)."""
    if reply.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts[token]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    tops: Sequence[Sequence[tuple[int, float]]] = reply.top_logprobs or [()] * len(reply.tokens)
    for token, logprob, alternatives in zip(reply.tokens, reply.logprobs, tops, strict=True):
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in alternatives[:top]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion(
    request_id: str,
    created: int,
    model: str,
    reply: Reply,
    shown: Shown,
    logprobs_content: dict[str, Any] | None,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": shown.content if shown.content or not shown.calls else None,
        "refusal": None,
    }
    if shown.calls:
        message["tool_calls"] = calls(shown)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs_content,
                "finish_reason": shown.finish_reason,
            }
        ],
        "usage": usage(reply),
        "system_fingerprint": None,
    }


def chunk(
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    *,
    finish_reason: str | None = None,
    logprobs_content: dict[str, Any] | None = None,
    usage_of: Reply | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (with no choice, and the usage: the last one)."""
    out: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs_content,
                "finish_reason": finish_reason,
            }
        ],
    }
    if usage_of is not None:
        out["usage"] = usage(usage_of)
    return out


def error(exc: ApiError) -> dict[str, Any]:
    kind = {
        "invalid_request_error": "invalid_request_error",
        "authentication_error": "invalid_request_error",
        "not_found_error": "invalid_request_error",
        "request_too_large": "invalid_request_error",
    }.get(exc.kind, "server_error")
    code = exc.code
    if code is None and exc.kind == "authentication_error":
        code = "invalid_api_key"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": code}}


def sse(data: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


TokenTexts = Callable[[Sequence[int]], Awaitable[list[str]]]


class Answer:
    """A Chat Completions reply: a ``chat.completion``, or its chunks."""

    api = "openai"

    def __init__(self, request: Request, token_texts: TokenTexts) -> None:
        self._request = request
        self._token_texts = token_texts
        self._id = f"chatcmpl-{secrets.token_hex(12)}"
        self._created = int(time.time())

    def _chunk(self, delta: dict[str, Any] | None, **more: Any) -> bytes:
        return sse(chunk(self._id, self._created, self._request.model, delta, **more))

    async def _logprobs(self, reply: Reply) -> dict[str, Any] | None:
        if not self._request.logprobs or reply.logprobs is None:
            return None
        ids = sorted({*reply.tokens, *(t for top in reply.top_logprobs or () for t, _ in top)})
        texts = dict(zip(ids, await self._token_texts(ids), strict=True))
        return logprobs(reply, texts, self._request.top_logprobs)

    async def body(self, reply: Reply, shown: Shown) -> dict[str, Any]:
        content = await self._logprobs(reply)
        return completion(self._id, self._created, self._request.model, reply, shown, content)

    def opening(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list[bytes]:
        return [self._chunk({"content": piece})]

    async def closing(self, reply: Reply, shown: Shown) -> list[bytes]:
        out = []
        if shown.calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls(shown))]
            out.append(self._chunk({"tool_calls": deltas}))
        content = await self._logprobs(reply)
        out.append(self._chunk({}, finish_reason=shown.finish_reason, logprobs_content=content))
        if self._request.include_usage:
            out.append(self._chunk(None, usage_of=reply))
        out.append(b"data: [DONE]\n\n")
        return out

    def failure(self, exc: ApiError) -> list[bytes]:
        return [sse(error(exc))]

    def error(self, exc: ApiError) -> dict[str, Any]:
        return error(exc)
