"""The model families of the original design, as tiny random configs with their real layer
patterns: Llama, Qwen 2.5, Gemma 3 (five sliding-window layers to one global) and Qwen MoE.
Replies through the actors equal mlx-lm's; sliding layers hold only their window."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import mlx_lm
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import UnsupportedModelError
from mlx_actors.scheduler import (
    BLOCK_SIZE,
    SLIDING_MARGIN,
    BlockPool,
    BlockPoolBatchEngine,
    LayerKind,
)
from mlx_actors.scheduler.kv import runs_of
from mlx_actors.testing import family_configs, write_random_model

from ..conftest import Loaded, ReferenceChat, asyncio_only, load, render, run_to_completion
from .test_spec import MAMBA

# What these tests check does not depend on the event loop.
anyio_backend = asyncio_only()

WINDOW = 40
FAMILIES = family_configs(WINDOW)
TURNS = ["Hello there, how are you today?", "Tell me about the sea.", "And the mountains?"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("families") / request.param
    # Gemma's scaled embeddings saturate at 4.0 (every reply one repeated token); at 1.0
    # its replies vary with every cached token, as the others' do at 4.0.
    scale = 1.0 if request.param == "gemma3_text" else 4.0
    return load(write_random_model(path, FAMILIES[request.param], seed=11, init_scale=scale))


def test_the_cache_spec_follows_the_layer_pattern(family: Loaded) -> None:
    kinds = [layer.kind for layer in family.spec.layers]
    if family.model.model_type == "gemma3_text":
        assert kinds == [LayerKind.SLIDING] * 5 + [LayerKind.GLOBAL]
        assert {layer.window for layer in family.spec.layers[:5]} == {WINDOW}
    else:  # Llama, Qwen 2.5 and the MoE model all keep plain KV caches
        assert set(kinds) == {LayerKind.GLOBAL}


@pytest.mark.anyio
async def test_dialogues_equal_mlx_lm_alone_and_batched(family: Loaded, anyio_backend: str) -> None:
    eos = family.tokenizer.eos_token_ids
    async with Runtime(family.path, pool_blocks=300, log_level="off") as rt:
        agents = [
            await rt.spawn(f"a{i}", system=f"You are agent number {i}.", max_tokens=24)
            for i in range(3)
        ]
        replies: dict[str, list[Any]] = {a.name: [] for a in agents}

        async def converse(agent: Any) -> None:
            for text in TURNS:
                replies[agent.name].append(await agent.ask(text))

        await converse(agents[0])  # alone
        async with anyio.create_task_group() as tg:  # the other two, batched together
            for agent in agents[1:]:
                tg.start_soon(converse, agent)
        stats = await rt.stats()
        assert stats.max_batch_size >= 2
        assert stats.pool.used_blocks == sum(a.statistics().cached_blocks for a in agents)
        histories = {a.name: a.history for a in agents}
    for name, history in histories.items():
        chat = ReferenceChat(family.model, eos)
        for turn, reply in enumerate(replies[name]):
            prompt = render(family.tokenizer, history[: 2 + 2 * turn])
            assert list(reply.tokens) == chat.turn(prompt, 24), (name, turn)
        # the history outgrew the sliding window, so the windowed layers were exercised
        assert len(chat.tokens) > 2 * WINDOW


def test_sliding_layers_keep_only_their_window_and_the_turns_start(family: Loaded) -> None:
    pool = BlockPool(family.spec, total_blocks=400)
    engine = BlockPoolBatchEngine(family.model, family.tokenizer, pool)
    blocks = None
    total = 0
    for turn, n in enumerate([300, 260, 500]):  # the history crosses several blocks
        prompt = [(7 * i + turn) % 256 for i in range(n)]
        uid = engine.submit("a", prompt, blocks, max_tokens=5)
        result = run_to_completion(engine)[uid]
        engine.release(blocks)
        start, blocks = total, result.blocks
        total = blocks.num_tokens
        for layer, layer_blocks in zip(family.spec.layers, blocks.layers):
            held = runs_of([(b, b.end) for b in layer_blocks])
            if layer.kind is LayerKind.GLOBAL:
                assert len(layer_blocks) == math.ceil(total / BLOCK_SIZE)
                assert held == [(0, total)]
            else:
                # The window at the end with the margin before it, and the window
                # where the turn started (the turn was longer than both: two runs);
                # older tokens were dropped.
                window = (total - WINDOW - SLIDING_MARGIN, total)
                assert held[-1] == window
                if start:  # (the checkpoint reaches back to its blocks' start at most)
                    (first, end), *_ = held
                    assert len(held) == 2 and end == start
                    assert (start - WINDOW) // BLOCK_SIZE * BLOCK_SIZE <= first
                    assert first <= start - WINDOW
                else:
                    assert len(held) == 1
                end_blocks = math.ceil((WINDOW + SLIDING_MARGIN) / BLOCK_SIZE) + 1
                assert len(layer_blocks) <= end_blocks + math.ceil(WINDOW / BLOCK_SIZE) + 1
        assert pool.used_blocks == blocks.num_blocks
    assert total > 1000
    engine.release(blocks)
    assert pool.statistics().used_blocks == 0


@pytest.mark.anyio
async def test_a_model_with_recurrent_layers_is_refused_at_start(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "mamba", MAMBA)
    with pytest.raises(UnsupportedModelError, match="ArraysCache"):
        async with Runtime(path, log_level="off"):
            pass
    mlx_lm.load(str(path))  # a real model that mlx-lm itself runs
