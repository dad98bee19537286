"""Reading a request's JSON body: each field checked for its type, with an error that
names it (both APIs' bodies are read this way)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ._errors import ApiError


def loads(body: bytes) -> dict[str, Any]:
    """The request's JSON object."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


def text(body: Mapping[str, Any], name: str, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name)
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {_shown(value)}", param=name)
    return value


def integer(body: Mapping[str, Any], name: str, *, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        more = f" >= {low}" if low is not None else ""
        raise ApiError(400, f"'{name}' must be an integer{more}, got {_shown(value)}", param=name)
    return value


def number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {_shown(value)}", param=name)
    return float(value)


def flag(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {_shown(value)}", param=name)
    return value


def array(body: Mapping[str, Any], name: str, *, required: bool = False) -> list[Any]:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name)
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"'{name}' must be an array, got {_shown(value)}", param=name)
    return value


def mapping(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be an object, got {_shown(value)}", param=name)
    return value


def entry(value: object, where: str) -> dict[str, Any]:
    """An object inside an array (a message, a tool, a content block)."""
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be an object, got {_shown(value)}", param=where)
    return value


def stops(value: object, name: str) -> list[str] | None:
    """A stop string or a list of them."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ApiError(400, f"'{name}' must be a string or an array of strings", param=name)


def unsupported(body: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """Refuse a field this server cannot honour (``names``: field -> why)."""
    for name, why in names.items():
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported: {why}", param=name)


def _shown(value: object) -> str:
    shown = json.dumps(value, default=repr)
    return shown if len(shown) <= 60 else f"{shown[:57]}..."
