"""Bad input and misuse get typed errors that say what happened: broken model
directories, bad arguments, a call from another event loop, a stream read at the wrong
time, a runtime used after it ended."""

from __future__ import annotations

import functools
import json
import math
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import (
    InvalidRequestError,
    MlxActorsError,
    ModelIntegrityError,
    RuntimeClosedError,
    UnsupportedModelError,
)
from mlx_actors.runtime._models import load_model
from mlx_actors.testing import tiny_config, write_random_model

pytestmark = pytest.mark.anyio


def _broken_models(base: Path) -> dict[str, Path]:
    """Model directories broken in the ways users' downloads break."""
    made = {}

    def model(name: str, **changes: Any) -> Path:
        path = write_random_model(base / name, tiny_config(), seed=1)
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
        made[name] = path
        return path

    model("bad_json").joinpath("config.json").write_text("{not json")
    model("unknown_type", model_type="no_such_model")
    config = model("missing_field") / "config.json"
    data = json.loads(config.read_text())
    del data["hidden_size"]
    config.write_text(json.dumps(data))
    weights = model("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    model("wrong_shape", intermediate_size=96)
    (model("bad_tokenizer") / "tokenizer.json").write_text("{")
    return made


def test_broken_model_directories_raise_typed_errors(tmp_path: Path) -> None:
    for name, path in _broken_models(tmp_path).items():
        with pytest.raises(MlxActorsError) as info:
            load_model(path)
        expected = UnsupportedModelError if name == "unknown_type" else ModelIntegrityError
        assert isinstance(info.value, expected), (name, info.value)
        assert str(path) in str(info.value)


async def test_bad_arguments_raise_typed_errors(tiny_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InvalidRequestError, match="trace file"):
        Runtime(tiny_dir, trace=blocker / "trace.jsonl")
    rt = Runtime(tiny_dir, pool_blocks=100, log_level="off")
    async with rt:
        ann = await rt.spawn("ann", max_tokens=4, temperature=1.0)
        bad: list[dict[str, Any]] = [
            {"stop": 123},
            {"stop": [1, 2]},
            {"stop": ["x"] * 20_000},
            {"stop": "y" * 5_000},
            {"timeout": math.nan},
            {"timeout": -1},
            {"seed": -1},
            {"seed": 2**70},
        ]
        for options in bad:
            with pytest.raises(InvalidRequestError):
                await ann.ask("Hello", **options)
        for text in ["bad \ud800 surrogate", "x" * 1_000_000, b"bytes", ""]:
            with pytest.raises(InvalidRequestError):
                await ann.ask(text)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            await rt.spawn("bob", system="lone \udfff")
        await ann.ask("Hello", seed=2**64 - 1)  # the largest seed is fine
        assert len(ann.history) == 2
    with pytest.raises(InvalidRequestError, match="only once"):
        async with rt:
            pass


async def test_an_ask_from_another_event_loop_is_refused_or_forwarded(tiny_dir: Path) -> None:
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        outcome: list[Any] = []

        def other_thread() -> None:
            async def ask() -> Any:
                return await ann.ask("Hello")

            try:
                outcome.append(anyio.run(ask))
            except Exception as exc:
                outcome.append(exc)
            # the way that works: run the call on the runtime's own loop
            outcome.append(anyio.from_thread.run(functools.partial(ann.ask, "Hi"), token=rt.token))
            anyio.from_thread.run_sync(done.set, token=rt.token)

        done = anyio.Event()
        threading.Thread(target=other_thread, daemon=True).start()
        with anyio.fail_after(60):  # an ask stuck in the other loop would never return
            await done.wait()
        refused, forwarded = outcome
        assert isinstance(refused, InvalidRequestError) and "event loop" in str(refused)
        assert forwarded.text == ann.history[-1].content


async def test_misuse_gets_typed_errors_that_say_what_happened(tiny_dir: Path) -> None:
    """Reading a stream's reply too early or after leaving it, spawning after the
    runtime ended, ``run`` inside a running event loop (a notebook): before, a bare
    ``RuntimeError``, or advice to use ``async with`` to one who did."""
    from mlx_actors import run

    async def main() -> None:
        pass

    with pytest.raises(InvalidRequestError, match="notebook"):
        run(main)
    async with Runtime(tiny_dir, pool_blocks=40, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=30)
        async with ann.stream("Tell me a story") as pieces:
            with pytest.raises(InvalidRequestError, match="has not finished"):
                pieces.reply  # noqa: B018
        # left at once: the turn is cancelled, and the agent as it was
        with pytest.raises(MlxActorsError, match="cancelled"):
            pieces.reply  # noqa: B018
        assert ann.history == ()
    with pytest.raises(RuntimeClosedError, match="has shut down"):
        await rt.spawn("bob")
