"""How one model reads tools and writes tool calls: the conversation as its chat
template takes it, the calls found in a reply, and the grammar of a call that must come.

A model whose chat template renders tools, and whose call format mlx-lm knows (its
``tool_parsers``: the JSON format of Qwen and Hermes, Mistral's, the pythonic one...),
gets them its own way: ``tools=`` to the template, calls as ``tool_calls`` of the
assistant's message, results as ``tool`` messages, calls read by mlx-lm's parser. Any
other model (a template that knows nothing of tools, as SmolLM2's) gets the JSON format
in its system prompt, in the words Qwen 2.5's template uses, its calls kept as the text
it wrote and the results given back as a user message of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..errors import InvalidRequestError
from ..scheduler import check_grammar
from ._reply import Message
from ._tools import Tool, ToolCall

#: The JSON call format's markers (mlx-lm's ``json_tools``).
JSON_START, JSON_END = "<tool_call>", "</tool_call>"

_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


#: Calls are written as chat templates write them back (``tojson``, as ``json.dumps``:
#: one space after commas and colons), so that a call rendered again reads as the cache.
_AS_TEMPLATES_WRITE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@attrs.frozen
class ToolFormat:
    """One model's way with tools (see the module's docstring); :func:`tool_format`."""

    #: Whether the chat template renders tools and calls itself.
    native: bool
    start: str
    end: str
    #: Reads the text between the markers: a call (``name``, ``arguments``) or a list.
    parse_text: Callable[[str, Any], Any]
    #: Whether calls are JSON objects between the markers (a grammar can force one).
    json_calls: bool

    def conversation(
        self, system: str | None, messages: Sequence[Message], tools: Sequence[Tool]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages for the chat template, and its extra arguments."""
        specs = [t.spec() for t in tools]
        if self.native:
            head = [{"role": "system", "content": system}] if system else []
            body = [self._native(m) for m in messages]
            return [*head, *body], {"tools": specs} if specs else {}
        prompt = system or ""
        if specs:
            listed = "".join(f"\n{json.dumps(s, ensure_ascii=False)}" for s in specs)
            tools_text = _TOOLS_PROMPT.format(tools=listed)
            prompt = f"{prompt}\n\n{tools_text}" if prompt else tools_text
        out: list[dict[str, Any]] = [{"role": "system", "content": prompt}] if prompt else []
        for m in messages:
            if m.role == "tool":
                block = f"<tool_response>\n{m.content}\n</tool_response>"
                if out and out[-1].get("tool_results"):
                    out[-1]["content"] += f"\n{block}"
                else:
                    out.append({"role": "user", "content": block, "tool_results": True})
            else:
                out.append({"role": m.role, "content": m.content})
        for entry in out:
            entry.pop("tool_results", None)
        return out, {}

    def _native(self, message: Message) -> dict[str, Any]:
        if message.role == "tool":
            return {
                "role": "tool",
                "content": message.content,
                "name": message.name,
                "tool_call_id": message.tool_call_id,
            }
        # A call that could not be read (cut by max_tokens, say) is not shown as a call
        # the model never made: the text it wrote stays.
        calls = [c for c in message.tool_calls if c.error is None]
        if message.role == "assistant" and calls:
            return {
                "role": "assistant",
                "content": self.before_calls(message.content),
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": dict(c.arguments)},
                    }
                    for c in calls
                ],
            }
        return {"role": message.role, "content": message.content}

    def before_calls(self, text: str) -> str:
        """The reply's text before its first call."""
        at = text.find(self.start)
        return text if at < 0 else text[:at].rstrip()

    def written(self, text: str, calls: Sequence[ToolCall]) -> str:
        """A reply of ``text`` then ``calls`` as the JSON format writes them (the form
        a required call takes)."""
        written = [
            f"{self.start}\n"
            f"{json.dumps({'name': c.name, 'arguments': dict(c.arguments)}, ensure_ascii=False)}"
            f"\n{self.end}"
            for c in calls
        ]
        return "\n".join([text, *written] if text else written)

    def calls(self, text: str, key: object, tools: Sequence[Tool]) -> tuple[ToolCall, ...]:
        """The calls written in ``text``, with ids made from ``key`` and their number
        (:func:`call_id`). A call that cannot be read is one with an ``error``, which
        the model is shown."""
        found: list[ToolCall] = []
        at = text.find(self.start)
        specs = [t.spec() for t in tools]
        while at >= 0:
            body_at = at + len(self.start)
            end = text.find(self.end, body_at) if self.end else -1
            body = text[body_at:] if end < 0 else text[body_at:end]
            try:
                parsed = self.parse_text(body, specs)
                items = parsed if isinstance(parsed, list) else [parsed]
                for item in items:
                    name, arguments = item["name"], item.get("arguments", {})
                    if isinstance(arguments, str):
                        arguments = json.loads(arguments)
                    if not isinstance(name, str) or not isinstance(arguments, Mapping):
                        raise ValueError("a call needs a name and an arguments object")
                    found.append(
                        ToolCall(id=call_id(key, len(found)), name=name, arguments=arguments)
                    )
            except Exception as exc:
                found.append(
                    ToolCall(
                        id=call_id(key, len(found)),
                        name="",
                        error=f"the call {body.strip()[:200]!r} could not be read: {exc}",
                    )
                )
            if end < 0:
                break
            at = text.find(self.start, end + len(self.end))
        return tuple(found)

    def call_grammar(self, tools: Sequence[Tool], answer: Mapping[str, Any] | None) -> str:
        """An llguidance (Lark) grammar for a reply that is one call of ``tools`` or,
        with ``answer`` (a JSON schema), that or an answer of that schema."""
        if not self.json_calls:
            raise InvalidRequestError(
                f"this model writes tool calls as {self.start}...{self.end}, not as JSON "
                "objects: a call cannot be required of it (tool_choice='auto' works)"
            )
        start, end = json.dumps(f"{self.start}\n"), json.dumps(f"\n{self.end}")
        names = " | ".join(f"call_{i}" for i in range(len(tools)))
        grammar = f"start: {start} call {end}\ncall: {names}\n"
        for i, t in enumerate(tools):
            # Each tool's call is a schema of its own, so that the ``$defs`` of its
            # arguments (pydantic's, for a model or an Enum) resolve from its root.
            arguments = {k: v for k, v in t.parameters.items() if k != "$defs"}
            call = {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
                "x-guidance": _AS_TEMPLATES_WRITE,
            }
            if "$defs" in t.parameters:
                call["$defs"] = t.parameters["$defs"]
            grammar += f"call_{i}: %json {json.dumps(call)}\n"
        if answer is not None:
            grammar = grammar.replace("start: ", "start: answer | ", 1)
            schema = {**answer, "x-guidance": {"whitespace_flexible": False}}  # as schema=
            grammar += f"answer: %json {json.dumps(schema)}\n"
        return check_grammar(grammar, "the tools' schemas")


def call_id(*parts: object) -> str:
    """Nine letters and digits, the same for the same ``parts``: an id every template
    takes (Mistral's insist on exactly nine alphanumerics)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


_ALNUM = string.ascii_letters + string.digits


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format of ``tokenizer``'s model (an mlx-lm tokenizer)."""
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    parser = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    renders_tools = isinstance(template, str) and "tools" in template
    if parser is not None and start and renders_tools:
        end = getattr(tokenizer, "tool_call_end", None) or ""
        json_calls = (start, end) == (JSON_START, JSON_END)
        return ToolFormat(True, start, end, parser, json_calls)
    return ToolFormat(False, JSON_START, JSON_END, _parse_json, True)


def _parse_json(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())
