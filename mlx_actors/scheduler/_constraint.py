"""Constrained decoding: a reply that must follow a grammar (a JSON schema's), token by
token, as one sequence's logits processor, driven by llguidance.

llguidance (the grammar engine of Guidance, also used by vLLM and llama.cpp) compiles a
JSON schema into a grammar and, given the tokens so far, computes which tokens may come
next, lazily, from the tokenizer's trie: no index is built per schema. This module owns
the glue: the schema (a dict, or a pydantic model class) to grammar, the model's
tokenizer as llguidance's (built once per engine), the mask applied to the logits with
plain MLX ops (llguidance's own MLX helper is a Metal kernel; this runs on any backend),
and the reply parsed back. A :class:`Constraint` is an mlx-lm logits processor like the
penalties, so it works alone (``Solo``) and inside the ``BatchGenerator``, where the
other sequences' logits are untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ..errors import EngineError, InvalidRequestError, ReplyFormatError

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


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """mlx-lm's tokenizer (a ``TokenizerWrapper``) as llguidance's, for a model whose
    logits are ``vocab_size`` wide. Costs up to a second on large vocabularies."""
    eos = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos[0])
    except Exception as exc:
        raise InvalidRequestError(
            f"this model's tokenizer cannot drive constrained decoding: {exc}"
        ) from None


class Constraint:
    """A logits processor that masks every token ``grammar`` does not allow next.

    It reads the sequence's tokens (as mlx-lm hands them to processors: the whole
    sequence so far) from ``start``, the number before the reply, and feeds the ones it
    has not seen to its matcher (reading them waits for the device: a constrained
    sequence costs a synchronisation per token). Once the grammar is complete only the
    end-of-sequence token is allowed, so the sequence ends there. Under a grammar
    that always ends, so does the reply, whatever the model: only ``max_tokens`` (or a
    stop string) can cut it.
    """

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, grammar: str, start: int, vocab_size: int
    ) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the grammar is invalid: {self._matcher.get_error()}")
        self._start, self._seen = start, 0
        self._bits = allocate_token_bitmask(1, tokenizer.vocab_size)
        self._vocab = vocab_size
        self._allowed = np.zeros(vocab_size, dtype=np.bool_)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = tokens[self._start + self._seen :].tolist()
        assert isinstance(new, list)
        self._seen += len(new)
        for token in new:
            # A generator computes one step past the end: after the end-of-sequence
            # token (the grammar stopped), what comes is discarded.
            if self._matcher.is_stopped():
                break
            if not self._matcher.consume_token(token):  # type: ignore[arg-type]
                raise EngineError(f"the constraint failed: {self._matcher.get_error()}")
        fill_next_token_bitmask(self._matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(self._vocab, bits.size)
        self._allowed[:n] = bits[:n]
        return mx.where(mx.array(self._allowed), logits, -mx.inf)
