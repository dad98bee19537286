"""Tools: Python functions an agent may call. This module owns what a tool is (its name,
description and JSON schema, derived from the function or given), checking a call's
arguments, and running it so that whatever happens becomes text the model can read.

A function's schema comes from its signature and type hints through pydantic (which
then also checks and converts the arguments the model wrote before the call), and the
descriptions from its docstring (Google, NumPy or reST style, through docstring_parser).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import docstring_parser
import pydantic

from ..errors import InvalidRequestError

#: What a tool's result may be shown as, at most (longer results are cut, and say so).
MAX_RESULT_CHARS = 16_000
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@attrs.frozen(kw_only=True, eq=False)
class Tool:
    """A function an agent may call: what the model is told of it, and the function.

    Make one with :func:`tool`, or pass plain functions to ``spawn(tools=[...])``.
    ``function`` is ``None`` for a tool whose agent came back from a state directory
    until the function is given again (:meth:`Agent.use_tools`)."""

    name: str
    description: str
    #: A JSON schema of the arguments object.
    parameters: Mapping[str, Any]
    function: Callable[..., Any] | None = None
    #: Checks and converts the arguments (derived from the signature), if any.
    arguments_model: type[pydantic.BaseModel] | None = None

    def spec(self) -> dict[str, Any]:
        """The tool as chat templates and tool prompts take it (OpenAI's layout)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@attrs.frozen(kw_only=True)
class ToolCall:
    """A call the model wrote, and (in ``Reply.tool_calls``) what came of it."""

    #: Made up by the agent (``call_<turn>_<n>``): templates that show ids pair a call
    #: with its result by it.
    id: str
    name: str
    #: The arguments as the model wrote them (parsed JSON).
    arguments: Mapping[str, Any] = attrs.field(factory=dict)
    #: What the function returned (``None`` if it failed, or did not run).
    result: Any = None
    #: Why the call failed (unknown tool, bad arguments, an exception), if it did: the
    #: model was shown this instead of a result.
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The call as agent records keep it (with ``error`` for one that could not be
        read or run: a call that could not be read is not rendered as a call)."""
        out = {"id": self.id, "name": self.name, "arguments": dict(self.arguments)}
        if self.error is not None:
            out["error"] = self.error
        return out


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> Any:
    """Make a :class:`Tool` of ``function``; usable as a decorator, with or without
    arguments. ``name``, ``description`` and ``parameters`` (a JSON schema of the
    arguments object) replace what would be derived from the function. With an explicit
    ``parameters`` schema, arguments reach the function as the model wrote them.

    Raises:
        InvalidRequestError: the function's signature cannot be described (``*args``,
            ``**kwargs``, positional-only parameters, a type pydantic cannot describe).
    """
    if function is None:
        return functools.partial(tool, name=name, description=description, parameters=parameters)
    return as_tool(function, name=name, description=description, parameters=parameters)


def as_tool(
    function: Callable[..., Any] | Tool,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> Tool:
    """``function`` as a :class:`Tool` (a tool is returned as it is)."""
    if isinstance(function, Tool):
        return function
    if not callable(function):
        raise InvalidRequestError(f"a tool must be a function or a Tool, got {function!r}")
    doc = docstring_parser.parse(inspect.getdoc(function) or "")
    name = name if name is not None else getattr(function, "__name__", "")
    description = description if description is not None else _description(doc)
    model = None
    if parameters is None:
        model = _arguments_model(function, name, doc)
        parameters = _clean(model.model_json_schema())
    return Tool(
        name=check_tool_name(name),
        description=description,
        parameters=check_parameters(name, parameters),
        function=function,
        arguments_model=model,
    )


def as_tools(tools: Iterable[Callable[..., Any] | Tool] | None) -> tuple[Tool, ...]:
    """Tools of distinct names, in order."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or callable(tools):
        raise InvalidRequestError(f"tools must be a list of functions or Tools, got {tools!r}")
    made = tuple(as_tool(t) for t in tools)
    names = [t.name for t in made]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequestError(f"tool names must be distinct; {twice} appear twice")
    return made


def check_tool_choice(choice: str, tools: Sequence[Tool]) -> None:
    """Raise :class:`InvalidRequestError` unless ``choice`` is a ``tool_choice`` that
    ``tools`` allow: ``"auto"``, ``"none"``, or, with tools, ``"required"`` or one's name."""
    if choice in ("auto", "none"):
        return
    if not tools:
        raise InvalidRequestError(f"tool_choice={choice!r} needs tools, and there are none")
    if choice != "required":
        named_tools(choice, tools)


def named_tools(name: str, tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """The tool called ``name``, as a one-tool tuple."""
    chosen = tuple(t for t in tools if t.name == name)
    if not chosen:
        raise InvalidRequestError(
            f"tool_choice {name!r} is not 'auto', 'required', 'none' or one of the tools "
            f"{[t.name for t in tools]}"
        )
    return chosen


def check_tool_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= _NAME_CHARS:
        raise InvalidRequestError(
            f"a tool's name must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}"
        )
    return name


def check_parameters(name: str, parameters: object) -> Mapping[str, Any]:
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            f"tool {name!r}: parameters must be a JSON schema of an object, got {parameters!r}"
        )
    try:
        json.dumps(parameters)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"tool {name!r}: parameters are not JSON: {exc}") from None
    return parameters


def _description(doc: docstring_parser.Docstring) -> str:
    parts = [doc.short_description or "", doc.long_description or ""]
    return "\n\n".join(p.strip() for p in parts if p and p.strip())


def _arguments_model(
    function: Callable[..., Any], name: str, doc: docstring_parser.Docstring
) -> type[pydantic.BaseModel]:
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function, include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        raise InvalidRequestError(f"tool {name!r}: its signature cannot be read: {exc}") from None
    described = {p.arg_name: p.description for p in doc.params}
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise InvalidRequestError(
                f"tool {name!r}: parameter {parameter.name!r} is {parameter.kind.description}; "
                "a tool takes named arguments only"
            )
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (
            hints.get(parameter.name, Any),
            pydantic.Field(default, description=described.get(parameter.name)),
        )
    try:
        return pydantic.create_model(
            f"{name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise InvalidRequestError(
            f"tool {name!r}: its arguments cannot be described: {exc}"
        ) from None


def _clean(schema: dict[str, Any]) -> dict[str, Any]:
    """pydantic's schema without its ``title`` keys (they only repeat the names)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: strip(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    cleaned: dict[str, Any] = strip(schema)
    return cleaned


async def run_call(call: ToolCall, tools: Mapping[str, Tool]) -> tuple[ToolCall, str]:
    """Run ``call``: the call with its result or error, and the text the model is shown.

    Async functions run on the event loop, others on a worker thread (abandoned if the
    turn is cancelled). An unknown tool, arguments the schema refuses, an exception, or
    a result that is not JSON become an error the model reads, not a crash. A lone
    surrogate in that text (no tokenizer reads one) is shown as U+FFFD."""
    done, text = await _run_call(call, tools)
    return done, _SURROGATE.sub("\ufffd", text)


#: A code point no UTF-8 text holds: half of a surrogate pair.
_SURROGATE = re.compile("[\ud800-\udfff]")


async def _run_call(call: ToolCall, tools: Mapping[str, Tool]) -> tuple[ToolCall, str]:
    if call.error is not None:  # the model's text could not be read as a call
        return call, f"Error: {call.error}"
    found = tools.get(call.name)
    if found is None:
        error = f"there is no tool {call.name!r}; the tools are {sorted(tools)}"
        return attrs.evolve(call, error=error), f"Error: {error}"
    if found.function is None:
        error = f"tool {call.name!r} has no function in this process"
        return attrs.evolve(call, error=error), f"Error: {error}"
    try:
        arguments = _arguments(found, call.arguments)
    except Exception as exc:  # the model's fields, or a validator of the tool's own
        error = f"bad arguments for {call.name}: {exc}"
        return attrs.evolve(call, error=error), f"Error: {error}"
    try:
        if inspect.iscoroutinefunction(found.function):
            result = await found.function(**arguments)
        else:
            result = await anyio.to_thread.run_sync(
                functools.partial(found.function, **arguments), abandon_on_cancel=True
            )
            if inspect.isawaitable(result):
                result = await result
    except BaseException as exc:
        if not _raised_by_tool(exc):
            raise
        said = f": {exc}" if str(exc) else ""
        error = f"{call.name} raised {type(exc).__name__}{said}"
        return attrs.evolve(call, error=error), f"Error: {error}"
    try:
        text = result_text(result)
    except Exception as exc:  # not JSON, or nested past what json can write
        error = f"{call.name} returned {type(result).__name__}, which is not JSON: {exc}"
        return attrs.evolve(call, error=error), f"Error: {error}"
    return attrs.evolve(call, result=result), text


def _raised_by_tool(exc: BaseException) -> bool:
    """Whether ``exc``, out of a tool, is the tool's own failure (the model is told)
    rather than the turn's cancellation (which goes on). Everything else a tool's code
    raises is its failure, ``KeyboardInterrupt`` and ``SystemExit`` included: let out of
    the agent's task, they would end the event loop with every turn in it (asyncio
    re-raises them out of the loop). A tool's code can also raise a cancellation that is
    not the turn's: on asyncio, awaiting a future something else cancelled; the task
    itself is then not being cancelled."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        try:
            task = asyncio.current_task()
        except RuntimeError:  # not asyncio: trio's Cancelled is only ever the scope's
            return False
        cancelling = getattr(task, "cancelling", None)  # Python 3.11 on; else: the turn's
        return cancelling is not None and not cancelling()
    return True


def _arguments(found: Tool, given: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise TypeError(f"the arguments must be an object, got {given!r}")
    if found.arguments_model is None:
        return dict(given)
    checked = found.arguments_model.model_validate(dict(given))
    return {k: getattr(checked, k) for k in type(checked).model_fields}


def result_text(result: Any) -> str:
    """A tool's result as the model reads it: a string as it is, anything else as JSON
    (pydantic models through their own serialiser, which writes NaN and infinities as
    ``null``), cut at :data:`MAX_RESULT_CHARS`. Raises ``ValueError`` for what JSON
    cannot write (NaN and infinities included), ``TypeError`` for what it does not know."""
    if isinstance(result, str):
        text = result
    elif isinstance(result, pydantic.BaseModel):
        text = result.model_dump_json()
    else:
        text = json.dumps(result, ensure_ascii=False, allow_nan=False)  # NaN is not JSON
    if len(text) > MAX_RESULT_CHARS:
        text = f"{text[:MAX_RESULT_CHARS]}... [cut: {len(text):,} characters in all]"
    return text
