"""Fixtures: a tiny random llama written as an mlx-lm model directory and loaded by
``mlx_lm.load``, and the mlx-lm reference generation every test compares against."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec
from mlx_actors.testing import CHATML_TOOLS_TEMPLATE, tiny_config, write_random_model

#: Sharpens the random model so that its greedy output depends on every cached token.
INIT_SCALE = 4.0


@attrs.frozen
class Loaded:
    path: Path
    model: Any
    tokenizer: Any
    spec: ModelCacheSpec


def load(path: Path) -> Loaded:
    model, tokenizer = mlx_lm.load(str(path))
    return Loaded(path, model, tokenizer, ModelCacheSpec.from_model(model))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of the default model first: each takes up to a minute on a 2-core CPU,
    and one that starts last keeps the run going while the other workers are idle."""
    items.sort(key=lambda item: item.get_closest_marker("smollm") is None)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both of anyio's backends, except where what it checks
    does not depend on the event loop (the engine's exactness, sharing, the cluster):
    those modules run on asyncio alone (:func:`asyncio_only`), and their slowest checks
    run each case on one of the two (``anyio_backend`` parametrized with the case)."""
    return str(request.param)


def asyncio_only() -> Any:
    """``anyio_backend = asyncio_only()`` in a module: its async tests run on asyncio
    alone."""

    @pytest.fixture(name="anyio_backend")
    def one_loop() -> str:
        return "asyncio"

    return one_loop


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        tmp_path_factory.mktemp("models") / "tiny-llama",
        tiny_config(num_hidden_layers=3),
        seed=7,
        init_scale=INIT_SCALE,
    )


@pytest.fixture(scope="session")
def native_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose chat template renders tools (Qwen 2.5's way)."""
    return write_random_model(
        tmp_path_factory.mktemp("models") / "tiny-tools",
        tiny_config(num_hidden_layers=3),
        seed=7,
        init_scale=INIT_SCALE,
        chat_template=CHATML_TOOLS_TEMPLATE,
    )


#: Each tool format on one event loop (native on asyncio, the fallback on trio), for tests
#: whose loop does not change what they check: half the runs of the full cross.
EACH_TOOL_FORMAT_ON_ONE_LOOP = pytest.mark.parametrize(
    ("tools_model", "anyio_backend"),
    [("native", "asyncio"), ("fallback", "trio")],
    indirect=["tools_model"],
)


@pytest.fixture(scope="session", params=["native", "fallback"])
def tools_model(request: pytest.FixtureRequest, native_dir: Path, tiny_dir: Path) -> Loaded:
    """A model with a tools template, and one whose template knows nothing of tools."""
    return load(native_dir if request.param == "native" else tiny_dir)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> Loaded:
    return load(tiny_dir)


@pytest.fixture
def pool(tiny: Loaded) -> BlockPool:
    return BlockPool(tiny.spec, total_blocks=400)


@pytest.fixture
def engine(tiny: Loaded, pool: BlockPool) -> Iterable[BlockPoolBatchEngine]:
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, max_batch_size=8)
    yield engine
    engine.close()


def reference(
    model: Any,
    prompt: Sequence[int],
    max_tokens: int,
    cache: list[Any] | None = None,
    stop: Iterable[int] = (),
) -> list[int]:
    """mlx-lm's own greedy generation: ``generate_step`` through ``cache`` (updated in
    place, as ``mlx_lm.chat`` keeps it), stopping after a token in ``stop``."""
    stop = set(stop)
    out: list[int] = []
    for token, _ in generate_step(
        mx.array(list(prompt)), model, max_tokens=max_tokens, prompt_cache=cache
    ):
        out.append(int(token))
        if token in stop:
            break
    return out


class ReferenceChat:
    """A conversation fed to mlx-lm through one persistent prompt cache: each turn feeds
    only the tokens the cache lacks, trimming it when the rendering diverges."""

    def __init__(
        self,
        model: Any,
        stop: Iterable[int] = (),
        make_cache: Callable[[], list[Any]] | None = None,
    ) -> None:
        self.model = model
        self.make_cache = make_cache or (lambda: make_prompt_cache(model))
        self.cache = self.make_cache()
        self.tokens: list[int] = []
        self.stop = set(stop)

    def turn(self, full_prompt: Sequence[int], max_tokens: int) -> list[int]:
        common = 0
        for a, b in zip(self.tokens, full_prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(full_prompt) - 1)
        if common < len(self.tokens):
            if all(c.is_trimmable() for c in self.cache):
                for c in self.cache:
                    c.trim(len(self.tokens) - common)
            else:  # a sliding window that has moved on cannot rewind: start over
                self.cache = self.make_cache()
                common = 0
        out = reference(self.model, full_prompt[common:], max_tokens, self.cache, self.stop)
        self.tokens = [*full_prompt, *out]
        return out


def run_to_completion(engine: BlockPoolBatchEngine, limit: int = 10_000) -> dict[int, Any]:
    """Step until nothing is in flight; the finished generations by uid."""
    done: dict[int, Any] = {}
    for _ in range(limit):
        if not engine.active:
            return done
        for result in engine.step():
            done[result.uid] = result
    raise AssertionError("the engine did not finish")


def render(tokenizer: Any, messages: Iterable[Any]) -> list[int]:
    """The chat template applied as the agents apply it."""
    conversation = [m.as_dict() if hasattr(m, "as_dict") else m for m in messages]
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b
