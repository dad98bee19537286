"""Structured replies: decoding constrained to a JSON schema (llguidance), per sequence,
inside the shared batch, on a random-weight model: every constrained reply is valid, and
the unconstrained sequences beside it stay token-identical to mlx-lm."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import InvalidRequestError, ReplyFormatError
from mlx_actors.scheduler import (
    BlockPoolBatchEngine,
    Constraint,
    Sampling,
    grammar_tokenizer,
    parse_reply,
    schema_grammar,
)

from ..conftest import Loaded, reference, run_to_completion


class Verdict(pydantic.BaseModel):
    winner: Literal["ann", "bob", "tie"]
    score: int = pydantic.Field(ge=0, le=10)
    reason: str = pydantic.Field(max_length=12)


SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 99}, "maxItems": 4},
    Verdict.model_json_schema(),
]


def constraint(engine: BlockPoolBatchEngine, schema: Any, start: int) -> Constraint:
    tokenizer = grammar_tokenizer(engine.tokenizer, engine.vocab_size)
    return Constraint(tokenizer, schema_grammar(schema), start, engine.vocab_size)


def test_constrained_replies_are_valid_and_their_neighbours_unchanged(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    rng = random.Random(3)
    eos = tiny.tokenizer.eos_token_ids
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(2, 30))] for _ in range(32)]
    uids = []
    for i, prompt in enumerate(prompts):
        schema = SCHEMAS[i % len(SCHEMAS)] if i % 2 == 0 else None
        processors = [constraint(engine, schema, len(prompt))] if schema is not None else []
        uid = engine.submit(f"a{i}", prompt, max_tokens=120, processors=processors)
        uids.append((uid, prompt, schema))
    done = run_to_completion(engine)
    assert engine.last_step is not None
    for uid, prompt, schema in uids:
        result = done[uid]
        if schema is None:
            assert list(result.tokens) == reference(tiny.model, prompt, 120, stop=eos)
        else:
            assert result.finish_reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), schema)


def test_a_constrained_sequence_alone_and_in_the_batch_gives_the_same_reply(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    """Alone it decodes outside the batch; joined half-way it continues in the batch
    (its constraint reads the tokens it produced alone); in a batch from the start, on
    a cached history (the constraint starts after it): the same greedy reply."""
    schema = SCHEMAS[0]
    first = engine.submit("h", [5, 6, 7, 8], max_tokens=6)
    history = run_to_completion(engine)[first]
    prompt = [9, 10, 11]
    start = 4 + len(history.tokens) + len(prompt)
    replies = []
    for joined in (None, 3, 0):
        uid = engine.submit(
            "c",
            prompt,
            history.blocks,
            max_tokens=120,
            processors=[constraint(engine, schema, start)],
        )
        if joined is not None:
            for _ in range(joined):
                engine.step()
            engine.submit("x", [1, 2, 3], max_tokens=40)
        replies.append(run_to_completion(engine)[uid])
    assert len({r.tokens for r in replies}) == 1
    jsonschema.validate(json.loads(replies[0].text), schema)


def test_a_bad_schema_is_refused() -> None:
    for bad in (
        {"type": "no-such-type"},
        "an object",
        42,
        {"minimum": "x", "type": "integer"},
        {"type": "integer", 1: "a key JSON cannot have"},
        {"anyOf": [{"type": "object", "properties": {2: {"type": "string"}}}]},
    ):
        with pytest.raises(InvalidRequestError):
            schema_grammar(bad)


def test_a_schema_that_contains_itself_is_refused() -> None:
    schema: dict[str, Any] = {"type": "object"}
    schema["properties"] = {"again": schema}
    with pytest.raises(InvalidRequestError, match="contains itself"):
        schema_grammar(schema)


def test_a_value_too_deep_to_read_is_a_reply_format_error() -> None:
    with pytest.raises(ReplyFormatError, match="too deeply"):
        parse_reply("[" * 100_000 + "]" * 100_000, {"type": "array"})


# -- through agents -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_agent_returns_a_parsed_verdict_and_streams_its_json(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        judge = await rt.spawn("judge", system="Judge the debate.", max_tokens=120)
        other = await rt.spawn("other", max_tokens=20)
        reply = await judge.ask("Who won?", schema=Verdict)
        assert isinstance(reply.data, Verdict)
        assert reply.data == Verdict.model_validate_json(reply.text)
        pieces = []
        async with judge.stream("And now?", schema=SCHEMAS[1]) as stream:
            async for piece in stream:
                pieces.append(piece)
        assert "".join(pieces) == stream.reply.text
        jsonschema.validate(stream.reply.data, SCHEMAS[1])
        plain = await other.ask("Hello")  # a plain turn after them: no constraint left
        assert plain.data is None
        assert [m.role for m in judge.history] == ["system", *["user", "assistant"] * 2]


class Picky(pydantic.BaseModel):
    winner: Literal["pro", "con"]

    @pydantic.field_validator("winner")
    @classmethod
    def refuse(cls, value: str) -> str:
        raise TypeError("no winner suits this validator")  # pydantic lets TypeError through


@pytest.mark.anyio
async def test_a_validator_that_fails_oddly_is_a_reply_format_error_and_undone(
    tiny_dir: Path,
) -> None:
    async with Runtime(tiny_dir, pool_blocks=24, log_level="off") as rt:
        judge = await rt.spawn("judge", max_tokens=120)
        other = await rt.spawn("other", max_tokens=8)
        await judge.ask("First")
        before = (judge.history, judge.statistics().cached_tokens)
        used = (await rt.stats()).pool.used_blocks
        with pytest.raises(ReplyFormatError, match="TypeError: no winner"):
            await judge.ask("Who won?", schema=Picky)
        assert (judge.history, judge.statistics().cached_tokens) == before
        stats = await rt.stats()
        assert stats.pool.used_blocks == used and stats.turns_in_flight == 0
        # The blocks came back and no turn is left in flight: another agent's turn runs.
        assert (await other.ask("Hello")).tokens


@pytest.mark.anyio
async def test_a_reply_cut_before_its_value_ends_is_an_error_and_undone(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off") as rt:
        judge = await rt.spawn("judge", max_tokens=120)
        await judge.ask("First", schema=Verdict)
        before = (judge.history, judge.statistics().cached_tokens)
        used = (await rt.stats()).pool.used_blocks
        with pytest.raises(ReplyFormatError) as info:
            await judge.ask("Second", schema=Verdict, max_tokens=5)
        assert info.value.text and not info.value.text.endswith("}")
        assert (judge.history, judge.statistics().cached_tokens) == before
        assert (await rt.stats()).pool.used_blocks == used
        with pytest.raises(InvalidRequestError, match="schema"):
            await judge.ask("Third", schema={"type": 3})
        assert judge.history == before[0]


def test_sampling_on_top_of_a_constraint_stays_valid(engine: BlockPoolBatchEngine) -> None:
    uids = [
        (
            engine.submit(
                f"s{i}",
                [1, 2, 3, i],
                max_tokens=400,  # escapes (\\uXXXX) make a 12-character string long
                sampling=Sampling(temperature=1.5, seed=i, repetition_penalty=1.3),
                processors=[constraint(engine, SCHEMAS[i % 4], 4)],
            ),
            SCHEMAS[i % 4],
        )
        for i in range(8)
    ]
    done = run_to_completion(engine)
    for uid, schema in uids:
        assert done[uid].finish_reason == "stop", done[uid].text
        jsonschema.validate(json.loads(done[uid].text), schema)
