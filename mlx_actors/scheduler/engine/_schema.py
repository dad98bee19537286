"""A reply's JSON schema: a mapping or a pydantic model class, checked and closed, as
llguidance's grammar; and the reply's text parsed back into its value. The engine only
sees the grammar (:mod:`._constraint` decodes under it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llguidance

from ...errors import InvalidRequestError, ReplyFormatError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: JSON without free whitespace: the shortest replies, one form for one value.
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}


def is_model_class(schema: object) -> bool:
    """Whether ``schema`` is a pydantic model class (anything with ``model_json_schema``)."""
    return isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None))


def json_schema(schema: object) -> dict[str, Any]:
    """``schema`` as a JSON schema: a mapping as it is, a pydantic model class's own.

    Raises:
        InvalidRequestError: neither.
    """
    if is_model_class(schema):
        closed = schema.model_config.get("extra") != "allow"  # type: ignore[attr-defined]
        schema = schema.model_json_schema()  # type: ignore[attr-defined]
        if closed:  # fields pydantic would ignore are not worth generating
            schema = _closed(schema)
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(
            f"schema must be a JSON schema (a dict) or a pydantic model class, got {schema!r}"
        )
    try:
        _check_keys(schema, "schema")
    except RecursionError:
        raise InvalidRequestError(
            "the schema is nested too deeply (or contains itself); use $ref for recursion"
        ) from None
    return dict(schema)


def _check_keys(node: Any, where: str) -> None:
    """Raise :class:`InvalidRequestError` at a key that is not a string (JSON has none)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                raise InvalidRequestError(
                    f"{where} has the key {key!r}: a JSON schema's keys are strings"
                )
            _check_keys(value, f"{where}[{key!r}]")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_keys(value, f"{where}[{i}]")


def _closed(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` on every object that has fields
    and says nothing of others."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_grammar(schema: object) -> str:
    """The llguidance grammar for replies valid against ``schema``: a JSON schema (a
    mapping) or a pydantic model class.

    Raises:
        InvalidRequestError: not a schema, or one llguidance cannot compile.
    """
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json_schema(schema), defaults=_COMPACT
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"the schema cannot be compiled: {exc}") from None
    return check_grammar(grammar, "the schema")


def check_grammar(grammar: str, what: str = "the grammar") -> str:
    """``grammar`` (llguidance's), if llguidance can compile it.

    Raises:
        InvalidRequestError: it cannot.
    """
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{what} cannot be compiled: {error}")
    return grammar


def parse_reply(text: str, schema: object) -> Any:
    """The reply's value: parsed JSON, or an instance of ``schema`` if it is a pydantic
    model class (:class:`ReplyFormatError` if the text is not a whole value)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ReplyFormatError(
            "the reply's value is nested too deeply for Python's json to read; bound the "
            "schema's depth",
            text=text,
        ) from None
    except ValueError:
        raise ReplyFormatError(
            "the reply is not a complete value of its schema: it was cut by max_tokens or "
            "a stop string; raise max_tokens or bound the schema (maxLength, maxItems)",
            text=text,
        ) from None
    if not is_model_class(schema):
        return value
    try:
        return schema.model_validate_json(text)  # type: ignore[attr-defined]
    except Exception as exc:  # a validator of the model refused the value, or failed
        raise ReplyFormatError(
            f"the reply's value does not validate as {schema.__name__}: "  # type: ignore[attr-defined]
            f"{type(exc).__name__}: {exc}",
            text=text,
        ) from None
