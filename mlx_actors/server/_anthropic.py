"""Anthropic's Messages (``POST /v1/messages``): a request's body as a :class:`Chat`, and
the reply as a ``message`` or a stream of its events in Anthropic's order."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from ..actors import Message, Reply, Tool, ToolCall, check_parameters, check_tool_name
from . import _fields as f
from ._chat import Chat, Shown
from ._errors import ApiError

UNSUPPORTED = {
    "container": "this server runs no code",
    "mcp_servers": "this server reaches no MCP servers",
}

KNOWN = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "service_tier",
        *UNSUPPORTED,
    }
)


@attrs.frozen(kw_only=True)
class Request:
    chat: Chat
    model: str


def parse(body: Mapping[str, Any], *, session: str | None) -> Request:
    """The request in ``body`` (``session``: the one the ``X-Session-Id`` header names)."""
    model = f.text(body, "model", required=True)
    assert model is not None
    f.unsupported(body, UNSUPPORTED)
    max_tokens = f.integer(body, "max_tokens", low=1)
    if max_tokens is None:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens")
    thinking = f.mapping(body, "thinking")
    if thinking is not None and thinking.get("type") != "disabled":
        raise ApiError(400, "extended thinking is not supported here", param="thinking")
    settings: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": f.number(body, "temperature"),
        "top_p": f.number(body, "top_p"),
        "top_k": f.integer(body, "top_k", low=0),
        "stop": f.stops(body.get("stop_sequences"), "stop_sequences"),
    }
    tools = tuple(_tool(t, i) for i, t in enumerate(f.array(body, "tools")))
    choice, parallel = _tool_choice(f.mapping(body, "tool_choice"))
    settings["tool_choice"] = choice
    metadata = f.mapping(body, "metadata") or {}
    user = f.text(metadata, "user_id")
    chat = Chat(
        conversation=_messages(f.array(body, "messages", required=True)),
        system=_system(body.get("system")),
        tools=tools,
        settings={k: v for k, v in settings.items() if v is not None},
        stream=bool(f.flag(body, "stream")),
        session=session if session is not None or not user else user,
        parallel_calls=parallel,
    )
    return Request(chat=chat, model=model)


def ignored(body: Mapping[str, Any]) -> list[str]:
    """Fields of ``body`` this server does not know (they are ignored)."""
    return sorted(k for k in body if k not in KNOWN)


def _system(system: object) -> str | None:
    if system is None or system == "":
        return None
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(_text_blocks(system, "system")) or None
    raise ApiError(400, "'system' must be a string or an array of text blocks", param="system")


def _text_blocks(blocks: list[Any], where: str) -> list[str]:
    texts = []
    for j, raw in enumerate(blocks):
        block = f.entry(raw, f"{where}[{j}]")
        if block.get("type") != "text":
            raise ApiError(
                400,
                f"{where}[{j}] is of type {block.get('type')!r}: this model reads text only",
                param=where,
            )
        value = f.text(block, "text", required=True)
        assert value is not None
        texts.append(value)
    return texts


def _messages(messages: list[Any]) -> tuple[Message, ...]:
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for its result
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        m = f.entry(raw, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(
                400, f"{where}.role must be 'user' or 'assistant', got {role!r}", param=where
            )
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(400, f"{where}.content must be a string or an array of blocks")
        if role == "assistant":
            message = _assistant(blocks, where)
            names.update((c.id, c.name) for c in message.tool_calls)
            out.append(message)
        else:
            out.extend(_user(blocks, where, names))
    if out[-1].role == "assistant":
        raise ApiError(
            400,
            "the last message is the assistant's: continuing a reply (a prefill) is not "
            "supported; end with a user message",
            param="messages",
        )
    return tuple(out)


def _assistant(blocks: list[Any], where: str) -> Message:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, raw in enumerate(blocks):
        block = f.entry(raw, f"{where}.content[{j}]")
        kind = block.get("type")
        if kind == "text":
            texts.append(f.text(block, "text") or "")
        elif kind == "tool_use":
            call_id = f.text(block, "id", required=True)
            name = f.text(block, "name", required=True)
            arguments = f.mapping(block, "input") or {}
            assert call_id is not None and name is not None
            calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # none was made here; the model never reads them back
        else:
            raise ApiError(400, f"{where}.content[{j}] is of type {kind!r}, not supported")
    return Message(role="assistant", content="\n".join(texts), tool_calls=tuple(calls))


def _user(blocks: list[Any], where: str, names: Mapping[str, str]) -> list[Message]:
    """A user message's blocks: each tool result as a tool message, the text between
    them as user messages."""
    out: list[Message] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(Message(role="user", content="\n".join(texts)))
            texts.clear()

    for j, raw in enumerate(blocks):
        at = f"{where}.content[{j}]"
        block = f.entry(raw, at)
        kind = block.get("type")
        if kind == "text":
            texts.append(f.text(block, "text") or "")
        elif kind == "tool_result":
            flush()
            call_id = f.text(block, "tool_use_id", required=True)
            assert call_id is not None
            content = block.get("content")
            if content is None:
                text = ""
            elif isinstance(content, str):
                text = content
            elif isinstance(content, list):
                text = "\n".join(_text_blocks(content, f"{at}.content"))
            else:
                raise ApiError(400, f"{at}.content must be a string or text blocks", param=at)
            if f.flag(block, "is_error"):
                text = f"Error: {text}"
            out.append(
                Message(role="tool", content=text, name=names.get(call_id), tool_call_id=call_id)
            )
        else:
            raise ApiError(
                400, f"{at} is of type {kind!r}: this model reads text and tool results only"
            )
    flush()
    return out


def _tool(raw: object, i: int) -> Tool:
    where = f"tools[{i}]"
    tool = f.entry(raw, where)
    if tool.get("type", "custom") not in ("custom", None):
        raise ApiError(
            400,
            f"{where} is a server tool ({tool.get('type')!r}): this server runs none; "
            "describe client tools with name, description and input_schema",
            param=where,
        )
    name = check_tool_name(tool.get("name"))
    schema = tool.get("input_schema") or {"type": "object", "properties": {}}
    return Tool(
        name=name,
        description=f.text(tool, "description") or "",
        parameters=check_parameters(name, schema),
    )


def _tool_choice(choice: Mapping[str, Any] | None) -> tuple[str | None, bool]:
    """The turn's ``tool_choice``, and whether several calls may come."""
    if choice is None:
        return None, True
    parallel = not f.flag(choice, "disable_parallel_tool_use")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return f.text(choice, "name", required=True), parallel
    raise ApiError(
        400, "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", param="tool_choice"
    )


# -- the reply ------------------------------------------------------------------------------


def stop_reason(reply: Reply, shown: Shown) -> str:
    if shown.finish_reason == "tool_calls":
        return "tool_use"
    if shown.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop is not None else "end_turn"


def usage(reply: Reply) -> dict[str, Any]:
    return {
        "input_tokens": reply.usage.prompt_tokens,
        "output_tokens": reply.usage.generated_tokens,
        "cache_read_input_tokens": reply.usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def blocks(shown: Shown) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if shown.content:
        out.append({"type": "text", "text": shown.content})
    for c in shown.calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": dict(c.arguments)})
    return out


def message(request_id: str, model: str, reply: Reply, shown: Shown) -> dict[str, Any]:
    return {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(shown),
        "stop_reason": stop_reason(reply, shown),
        "stop_sequence": reply.stop,
        "usage": usage(reply),
    }


def event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def error(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": exc.kind, "message": exc.message}}


class Answer:
    """A Messages reply: a ``message``, or its events in Anthropic's order."""

    api = "anthropic"

    def __init__(self, model: str) -> None:
        self._model = model
        self._id = f"msg_{secrets.token_hex(12)}"
        self._text_open = False

    async def body(self, reply: Reply, shown: Shown) -> dict[str, Any]:
        return message(self._id, self._model, reply, shown)

    def opening(self) -> list[bytes]:
        start: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [
            event("message_start", {"type": "message_start", "message": start}),
            event("ping", {"type": "ping"}),
        ]

    def text(self, piece: str) -> list[bytes]:
        out = []
        if not self._text_open:
            self._text_open = True
            block = {"type": "text", "text": ""}
            out.append(_block_event("content_block_start", 0, content_block=block))
        delta = {"type": "text_delta", "text": piece}
        out.append(_block_event("content_block_delta", 0, delta=delta))
        return out

    async def closing(self, reply: Reply, shown: Shown) -> list[bytes]:
        out = []
        index = 0
        if self._text_open:
            out.append(_block_event("content_block_stop", 0))
            index = 1
        for call in shown.calls:
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out.append(_block_event("content_block_start", index, content_block=block))
            out.append(_block_event("content_block_delta", index, delta=delta))
            out.append(_block_event("content_block_stop", index))
            index += 1
        end = {"stop_reason": stop_reason(reply, shown), "stop_sequence": reply.stop}
        out.append(
            event("message_delta", {"type": "message_delta", "delta": end, "usage": usage(reply)})
        )
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def failure(self, exc: ApiError) -> list[bytes]:
        return [event("error", error(exc))]

    def error(self, exc: ApiError) -> dict[str, Any]:
        return error(exc)


def _block_event(name: str, index: int, **fields: Any) -> bytes:
    return event(name, {"type": name, "index": index, **fields})
