"""Quantized KV blocks (``kv_bits``): replies token-identical to mlx-lm's own generation
through a quantized prompt cache (``QuantizedKVCache``), alone, batched, multi-turn,
with shared prefixes and long prompts, after eviction and after a restart; the batched
quantized cache mlx-lm lacks against the single one it has; the pool's arithmetic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from mlx_actors import Runtime, gather
from mlx_actors.errors import InvalidRequestError, ModelMismatchError, UnsupportedModelError
from mlx_actors.scheduler import (
    BatchQuantizedKVCache,
    BlockQuantizedKVCache,
    KVQuantization,
    ModelCacheSpec,
)
from mlx_actors.testing import family_configs, tiny_config, write_random_model

from .conftest import INIT_SCALE, Loaded, load, reference, render

EOS = [258]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """A tiny llama with heads of 32 (mx.quantize's smallest group)."""
    path = write_random_model(
        tmp_path_factory.mktemp("models") / "wide",
        tiny_config(num_hidden_layers=3, head_dim=32),
        seed=7,
        init_scale=INIT_SCALE,
    )
    return load(path)


def quantized_reference(model: Loaded, agent: Any, bits: int, max_tokens: int) -> list[int]:
    """mlx-lm's greedy reply to the agent's conversation before its last reply, through
    a prompt cache of ``QuantizedKVCache`` layers."""
    prompt = render(model.tokenizer, list(agent.history)[:-1])
    cache = [QuantizedKVCache(group_size=32, bits=bits) for _ in model.model.layers]
    return reference(model.model, prompt, max_tokens, cache, stop=EOS)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.anyio
async def test_replies_match_mlx_lm_quantized_alone_batched_and_shared(
    wide: Loaded, bits: int
) -> None:
    brief = "A long brief every agent reads first. " * 20  # over a block: shared blocks
    async with Runtime(
        wide.path, pool_blocks=300, log_level="off", kv_bits=bits, kv_group_size=32
    ) as rt:
        panel = [await rt.spawn(f"a{i}", system=brief, max_tokens=24) for i in range(5)]
        lone = await rt.spawn("lone", max_tokens=24)
        for turn in range(3):
            alone = await lone.ask(f"Alone, turn {turn}.")
            assert list(alone.tokens) == quantized_reference(wide, lone, bits, 24)
            replies = await gather(
                *(a.ask(f"{a.name}, turn {turn}" + " more" * (3 * i)) for i, a in enumerate(panel))
            )
            for agent, reply in zip(panel, replies):
                assert list(reply.tokens) == quantized_reference(wide, agent, bits, 24)
        long = await rt.spawn("long", max_tokens=8)  # a prompt long enough for a job
        reply = await long.ask("word " * 400)
        assert list(reply.tokens) == quantized_reference(wide, long, bits, 8)
        stats = await rt.stats()
        assert stats.max_batch_size >= 5 and stats.shared_blocks > 0


@pytest.mark.anyio
async def test_evicted_and_restarted_quantized_caches_come_back_exactly(
    wide: Loaded, tmp_path: Path
) -> None:
    options: dict[str, Any] = dict(
        pool_blocks=18, log_level="off", kv_bits=4, kv_group_size=32, state_dir=tmp_path
    )
    async with Runtime(wide.path, **options) as rt:
        agents = [await rt.spawn(f"a{i}", max_tokens=40) for i in range(4)]
        for turn in range(2):
            for agent in agents:
                reply = await agent.ask(f"{agent.name}, turn {turn}: " + "words " * 40)
                assert list(reply.tokens) == quantized_reference(wide, agent, 4, 40)
        stats = await rt.stats()
        assert stats.evictions > 0 and stats.restores > 0
    async with Runtime(wide.path, **options) as rt:
        agent = rt.agent("a0")
        reply = await agent.ask("After the restart?")
        assert list(reply.tokens) == quantized_reference(wide, agent, 4, 40)
        assert reply.usage.cached_tokens > 0  # from the quantized blocks on disk
    with pytest.raises(ModelMismatchError, match="quantized as 4-bit"):
        async with Runtime(wide.path, **{**options, "kv_bits": 8}):
            pass


def test_the_batched_cache_holds_what_the_single_ones_hold() -> None:
    singles = []
    for length in (5, 0, 17, 300):
        cache = BlockQuantizedKVCache(group_size=32, bits=4)
        if length:
            keys = mx.random.normal((1, 2, length, 64))
            cache.update_and_fetch(keys, keys * 2)
        singles.append(cache)
    batch = singles[0].merge(singles)
    assert isinstance(batch, BatchQuantizedKVCache) and batch.bits == 4
    new = mx.random.normal((4, 2, 3, 64))
    batch.update_and_fetch(new, new)  # three tokens each, appended
    for i, single in enumerate(singles):
        single.update_and_fetch(new[i : i + 1], new[i : i + 1])
    for i, single in enumerate(singles):
        got = batch.extract(i)
        assert got.offset == single.offset
        for a, b in zip((*got.keys, *got.values), (*single.keys, *single.values)):
            assert mx.array_equal(a, b[..., : single.offset, :]).item()
    keep = [3, 1]
    batch.filter(keep)
    other = singles[0].merge([singles[2], singles[0]])
    batch.extend(other)
    for i, single in enumerate([singles[k] for k in keep]):
        got = batch.extract(i)
        assert mx.array_equal(got.keys[0], single.keys[0][..., : single.offset, :]).item()


def test_block_bytes_and_settings(wide: Loaded) -> None:
    spec = ModelCacheSpec.from_model(wide.model)
    eight = ModelCacheSpec.from_model(wide.model, quantization=KVQuantization(8, 32))
    four = ModelCacheSpec.from_model(wide.model, quantization=KVQuantization(4, 32))
    # f32 heads of 32: 128 bytes each; 8 bits: 32 + a scale and a bias of 4 bytes each.
    assert spec.block_bytes / eight.block_bytes == 128 / 40
    assert spec.block_bytes / four.block_bytes == 128 / 24
    for bits, group in ((3, 64), (8, 16), (True, 64), (8.0, 64), (8, 32.0)):
        with pytest.raises(InvalidRequestError):
            KVQuantization(bits, group)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="kv_group_size"):
        ModelCacheSpec.from_model(wide.model, quantization=KVQuantization(8, 64))


@pytest.mark.anyio
async def test_sliding_window_models_are_refused_clearly(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "gemma", family_configs()["gemma3_text"], seed=1)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        async with Runtime(path, log_level="off", kv_bits=8, kv_group_size=32):
            pass
