"""Quantized KV blocks (``kv_bits``): replies token-identical to mlx-lm's own generation
through a quantized prompt cache (``QuantizedKVCache``), alone, batched, multi-turn,
with shared prefixes and long prompts, after eviction and after a restart; the batched
quantized cache mlx-lm lacks against the single one it has; the pool's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_actors import Runtime, gather
from mlx_actors.errors import (
    InvalidRequestError,
    ModelMismatchError,
    PoolExhaustedError,
)
from mlx_actors.scheduler import (
    BatchQuantizedKVCache,
    BlockPool,
    BlockQuantizedKVCache,
    KVQuantization,
    ModelCacheSpec,
)
from mlx_actors.scheduler.caches import _dequantized as dequantized
from mlx_actors.scheduler.caches import _quantize_kernels as kernels
from mlx_actors.scheduler.caches import _quantized
from mlx_actors.scheduler.caches._dequantized import (
    DequantizedBatchKVCache,
    DequantizedKVCache,
    QuantizedMarginBatchRotatingKVCache,
    QuantizedMarginRotatingKVCache,
)
from mlx_actors.testing import family_configs, tiny_config, write_random_model

from ..conftest import INIT_SCALE, Loaded, ReferenceChat, asyncio_only, load, reference, render

# What these tests check does not depend on the event loop.
anyio_backend = asyncio_only()

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


@pytest.mark.parametrize(("bits", "anyio_backend"), [(8, "asyncio"), (4, "trio")])
@pytest.mark.anyio
async def test_replies_match_mlx_lm_quantized_alone_batched_and_shared(
    wide: Loaded, bits: int
) -> None:
    brief = "A long brief every agent reads first. " * 20  # over a block: shared blocks
    async with Runtime(
        wide.path, pool_blocks=300, log_level="off", kv_bits=bits, kv_group_size=32
    ) as rt:
        panel = [await rt.spawn(f"a{i}", system=brief, max_tokens=24) for i in range(4)]
        lone = await rt.spawn("lone", max_tokens=24)
        for turn in range(2):
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
        assert stats.max_batch_size >= 4 and stats.shared_blocks > 0


@pytest.mark.anyio
async def test_a_setting_other_than_the_directorys_is_refused_in_words(
    wide: Loaded, tmp_path: Path
) -> None:
    async with Runtime(wide.path, pool_blocks=8, log_level="off", state_dir=tmp_path):
        pass
    with pytest.raises(
        ModelMismatchError,
        match="holds caches unquantized, and this runtime keeps them quantized to 8 bits in "
        "groups of 64;",
    ):
        async with Runtime(
            wide.path, pool_blocks=8, log_level="off", state_dir=tmp_path, kv_bits=8
        ):
            pass


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
    record = json.loads((tmp_path / "runtime.json").read_text())
    assert record["kv_cache"] == {"bits": 4, "group_size": 32}  # the device's path not in it
    with pytest.raises(
        ModelMismatchError,
        match="holds caches quantized to 4 bits in groups of 32, and this runtime keeps them "
        "quantized to 8 bits in groups of 32;",
    ):
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


GEMMA_WINDOW = 40


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """Gemma 3's kinds of layer (a sliding window of 40 tokens, and global), one of each
    (two layers step three times faster than Gemma 3's six), with heads of 32."""
    config = {
        **family_configs(GEMMA_WINDOW)["gemma3_text"],
        "head_dim": 32,
        "num_hidden_layers": 2,
        "sliding_window_pattern": 2,
    }
    path = tmp_path_factory.mktemp("models") / "gemma"
    return load(write_random_model(path, config, seed=11, init_scale=1.0))


class _RoundTrip:
    """Feeds the parent cache each key and value after ``mx.quantize`` and
    ``mx.dequantize`` (groups of 32)."""

    round_bits: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        def round_trip(x: mx.array) -> mx.array:
            data, scales, biases = mx.quantize(x, group_size=32, bits=self.round_bits)
            return mx.dequantize(data, scales, biases, group_size=32, bits=self.round_bits)

        return super().update_and_fetch(round_trip(keys), round_trip(values))  # type: ignore[misc]


class RoundTripRotatingKVCache(_RoundTrip, RotatingKVCache):  # type: ignore[misc]
    """mlx-lm's ``RotatingKVCache`` fed round-tripped keys and values: the reference for a
    quantized sliding-window layer (mlx-lm has no quantized rotating cache:
    ``RotatingKVCache.to_quantized`` raises)."""

    def __init__(self, max_size: int, bits: int) -> None:
        super().__init__(max_size)
        self.round_bits = bits


class RoundTripKVCache(_RoundTrip, KVCache):  # type: ignore[misc]
    """mlx-lm's ``KVCache`` fed round-tripped keys and values: the reference for a
    quantized global layer that attends over its keys and values dequantized."""

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.round_bits = bits


def mixed_cache(model: Any, bits: int) -> list[Any]:
    """The reference prompt cache for Gemma 3 with ``kv_bits``: mlx-lm's
    ``QuantizedKVCache`` in the global layers, :class:`RoundTripRotatingKVCache` in the
    sliding ones."""
    return [
        QuantizedKVCache(group_size=32, bits=bits)
        if type(c) is KVCache
        else RoundTripRotatingKVCache(c.max_size, bits)
        for c in make_prompt_cache(model)
    ]


@pytest.mark.parametrize(("bits", "anyio_backend"), [(8, "trio"), (4, "asyncio")])
@pytest.mark.anyio
async def test_gemma_with_quantized_global_layers_equals_mlx_lm(
    gemma: Loaded, bits: int, tmp_path: Path
) -> None:
    """Alone, batched, past the window, evicted under a small pool and after a restart,
    each agent's replies equal mlx-lm's through one persistent prompt cache of
    quantized global layers and round-tripping sliding ones."""
    eos = gemma.tokenizer.eos_token_ids
    turns = ["Hello there, how are you today?", "Tell me about the sea.", "And the hills?"]
    options: dict[str, Any] = dict(
        pool_blocks=14, log_level="off", kv_bits=bits, kv_group_size=32, state_dir=tmp_path
    )
    chats: dict[str, ReferenceChat] = {}

    async def converse(agent: Any, texts: list[str]) -> None:
        chat = chats.setdefault(
            agent.name, ReferenceChat(gemma.model, eos, lambda: mixed_cache(gemma.model, bits))
        )
        for text in texts:
            reply = await agent.ask(text)
            prompt = render(gemma.tokenizer, list(agent.history)[:-1])
            assert list(reply.tokens) == chat.turn(prompt, 24), (agent.name, text)

    async with Runtime(gemma.path, **options) as rt:
        spec = ModelCacheSpec.from_model(gemma.model, quantization=KVQuantization(bits, 32))
        assert all(layer.quantization is not None for layer in spec.layers)
        agents = [
            await rt.spawn(f"a{i}", system=f"You are agent number {i}.", max_tokens=24)
            for i in range(4)
        ]
        await converse(agents[0], turns)  # alone
        await gather(*(converse(a, turns) for a in agents[1:]))  # batched
        stats = await rt.stats()
        assert stats.max_batch_size >= 2 and stats.evictions > 0 and stats.restores > 0
        assert stats.pool.block_bytes == spec.block_bytes and stats.pool.total_blocks == 14
        assert all(len(chat.tokens) > 2 * GEMMA_WINDOW for chat in chats.values())
    async with Runtime(gemma.path, **options) as rt:
        await converse(rt.agent("a1"), ["After the restart?"])
        assert (await rt.agent("a1").ask("Once more.")).usage.cached_tokens > 0
    with pytest.raises(ModelMismatchError, match=f"holds caches quantized to {bits} bits"):
        async with Runtime(gemma.path, **{**options, "kv_bits": 12 - bits}):
            pass


def expected(packed: mx.array, dtype: mx.Dtype, q: KVQuantization) -> mx.array:
    """What a packed array of heads of 64 holds, dequantized."""
    data, scales, biases = _quantized.unpack(packed, 64, dtype, q)
    return mx.dequantize(data, scales, biases, group_size=q.group_size, bits=q.bits)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_quantized_window_hands_out_its_ring_dequantized(dtype: mx.Dtype) -> None:
    """Single and batched, through a prefill, decoding past the window, a merge and an
    extract: what the cache hands the model is its packed ring dequantized, bit for bit,
    and a decoding step dequantizes only its new token (the copy kept in step)."""
    q = KVQuantization(4, 32)
    calls: list[int] = []
    real = dequantized.dequantize_pair

    def counting(keys: mx.array, *args: Any) -> tuple[mx.array, mx.array]:
        calls.append(int(keys.shape[2]))
        return real(keys, *args)

    def check(cache: Any, got: tuple[mx.array, mx.array]) -> None:
        held = int(got[0].shape[2])
        for ring, out in zip((cache.keys, cache.values), got, strict=True):
            assert mx.array_equal(out, expected(ring[..., :held, :], dtype, q)).item()

    dequantized.dequantize_pair = counting  # type: ignore[assignment]
    try:
        caches = []
        for n in (5, 30):
            cache = QuantizedMarginRotatingKVCache(24, q)
            x = mx.random.normal((1, 2, n, 64)).astype(dtype)
            check(cache, cache.update_and_fetch(x, x * 2))
            caches.append(cache)
        calls.clear()
        for _ in range(40):  # past the window: the ring rotates
            x = mx.random.normal((1, 2, 1, 64)).astype(dtype)
            check(caches[0], caches[0].update_and_fetch(x, -x))
        # The first step grows the ring to the window (all of it dequantized once); then
        # only its new token (quantize_step).
        assert calls == [24]  # keys and values together, never the whole ring again
        batch = caches[0].merge(caches)
        assert isinstance(batch, QuantizedMarginBatchRotatingKVCache)
        for _ in range(30):
            x = mx.random.normal((2, 2, 1, 64)).astype(dtype)
            check(batch, batch.update_and_fetch(x, x))
        single = batch.extract(1)
        assert isinstance(single, QuantizedMarginRotatingKVCache)
        x = mx.random.normal((1, 2, 1, 64)).astype(dtype)
        check(single, single.update_and_fetch(x, x))
    finally:
        dequantized.dequantize_pair = real  # type: ignore[assignment]


@pytest.fixture(scope="module")
def elm(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """A tiny OpenELM: its layers have 1, 2 and 4 KV heads, so blocks of 1, 2 and 4 times
    the smallest size."""
    config = tiny_config(
        "openelm",
        head_dim=16,
        num_transformer_layers=3,
        model_dim=64,
        ffn_dim_divisor=8,
        num_query_heads=[4, 4, 4],
        num_kv_heads=[1, 2, 4],
        ffn_multipliers=[1.0, 1.0, 1.0],
    )
    path = tmp_path_factory.mktemp("models") / "elm"
    return load(write_random_model(path, config, seed=3, init_scale=INIT_SCALE))


def test_the_pool_counts_each_layers_blocks_at_their_size(elm: Loaded) -> None:
    """Layers whose blocks differ in size: the pool counts units of their common divisor,
    so that each block takes its real share."""
    spec = elm.spec
    sizes = [layer.block_bytes for layer in spec.layers]
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 4 * sizes[0]
    assert spec.unit_bytes == sizes[0] and [spec.units(i) for i in range(3)] == [1, 2, 4]
    assert spec.block_bytes == sizes[2] and spec.max_units == 4
    assert spec.units_held(300) == 2 * (1 + 2 + 4)
    pool = BlockPool.from_bytes(spec, 3 * sizes[2])
    assert pool.total_blocks == 12 and pool.budget_bytes == 3 * sizes[2]
    keys = [mx.zeros((1, layer.kv_heads, 256, 16)) for layer in spec.layers]
    reservation = pool.reserve(2 * 4)
    made = [reservation.allocate(2, 256 * i, keys[2], keys[2]) for i in range(2)]
    with pytest.raises(PoolExhaustedError, match="bug"):
        reservation.allocate(0, 512, keys[0], keys[0])
    block = pool.allocate(1, 0, keys[1], keys[1])  # outside any reservation
    assert pool.used_blocks == 2 * 4 + 2 and pool.statistics().reserved_blocks == 0
    with pytest.raises(PoolExhaustedError, match="needs 4 free units"):
        pool.allocate(2, 512, keys[2], keys[2])
    pool.free([*made, block])
    assert pool.free_blocks == pool.total_blocks
    with pytest.raises(InvalidRequestError, match="holds no block"):
        BlockPool.from_bytes(spec, sizes[2] - 1)


@pytest.mark.anyio
async def test_layers_of_different_sizes_share_the_pool_by_their_bytes(elm: Loaded) -> None:
    """Two agents of one block per layer fit a pool of six of the largest blocks: 24
    units, and a turn holds its agent's 1 + 2 + 4 and as many reserved beside the other
    agent's 7. Counted at the largest size (three blocks each, nine in all), one agent
    would have been evicted. Replies equal mlx-lm's."""
    eos = elm.tokenizer.eos_token_ids
    async with Runtime(elm.path, pool_blocks=6, log_level="off", share_prefixes=False) as rt:
        agents = [await rt.spawn(f"a{i}", max_tokens=12) for i in range(2)]
        for agent in agents:
            chat = ReferenceChat(elm.model, eos)
            for text in ("Hi.", "Again?"):
                reply = await agent.ask(text)
                prompt = render(elm.tokenizer, list(agent.history)[:-1])
                assert list(reply.tokens) == chat.turn(prompt, 12)
        stats = await rt.stats()
        assert stats.evictions == 0 and stats.resident_agents == 2
        assert stats.pool.total_blocks == 24 and stats.pool.used_blocks == 2 * (1 + 2 + 4)
        assert stats.pool.used_blocks * stats.pool.block_bytes == 2 * sum(
            layer.block_bytes for layer in elm.spec.layers
        )


def test_a_dequantized_global_cache_hands_out_its_arrays_dequantized() -> None:
    """Single and batched, through a prefill, growth past a step, merges (one of empty
    caches), an extract, a filter and an extend: what the cache hands the model is what
    it holds dequantized, bit for bit, and a decoding step dequantizes one token."""
    q = KVQuantization(4, 32, dequantize=True)
    calls: list[int] = []
    real = dequantized.dequantize_pair

    def counting(keys: mx.array, *args: Any) -> tuple[mx.array, mx.array]:
        calls.append(int(keys.shape[2]))
        return real(keys, *args)

    def step(cache: Any, rows: int = 1, n: int = 1) -> None:
        x = mx.random.normal((rows, 2, n, 64)).astype(mx.bfloat16)
        got = cache.update_and_fetch(x, -x)
        held = int(got[0].shape[2])
        assert held == (cache.offset if isinstance(cache, DequantizedKVCache) else cache._idx)
        for packed, out in zip((cache.keys, cache.values), got, strict=True):
            assert mx.array_equal(out, expected(packed[..., :held, :], mx.bfloat16, q)).item()

    dequantized.dequantize_pair = counting  # type: ignore[assignment]
    try:
        caches = [DequantizedKVCache(q) for _ in range(3)]
        step(caches[0], n=250)
        step(caches[1], n=20)
        calls.clear()
        for _ in range(10):  # past the first step of 256: the arrays grow once
            step(caches[0])
        assert calls == [512]
        empty = caches[2].merge([DequantizedKVCache(q), DequantizedKVCache(q)])
        assert isinstance(empty, DequantizedBatchKVCache) and empty.quantization == q
        step(empty, rows=2, n=3)
        batch = caches[0].merge(caches)
        assert isinstance(batch, DequantizedBatchKVCache)
        for _ in range(5):
            step(batch, rows=3)
        batch.filter([0, 1])
        batch.extend(empty)
        calls.clear()
        step(batch, rows=4)  # rebuilt whole after the moves, then one token a step
        step(batch, rows=4)
        assert len(calls) == 1
        single = batch.extract(1)
        assert isinstance(single, DequantizedKVCache) and single.offset == 20 + 7
        step(single)
    finally:
        dequantized.dequantize_pair = real  # type: ignore[assignment]


def test_a_conversion_kernel_is_used_only_where_it_gives_mlx_s_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CUDA GPU the dequantized path's conversions are kernels that check themselves
    once per combination against MLX's ops and are used only if every bit agrees. Here
    (no GPU) the launch is MLX's ops, exact or one value off, to drive that choice."""
    launched: list[str] = []

    def exact(
        kind: str,
        keys: mx.array,
        values: mx.array,
        dk: int,
        dv: int,
        dtype: mx.Dtype,
        q: KVQuantization,
    ) -> list[mx.array]:
        launched.append(kind)
        if kind == "quantize":
            return list(kernels._quantize_with_ops(keys, values, q))
        return [kernels.dequantize_packed(a, d, dtype, q) for a, d in ((keys, dk), (values, dv))]

    def off(*args: Any) -> list[mx.array]:
        out = exact(*args)
        out[-1] = out[-1] + out[-1][..., :1, :1, :1] * 0 + 1  # every value moved by one
        return out

    monkeypatch.setattr(kernels, "kernel_available", lambda: True)
    monkeypatch.setattr(kernels, "_agrees", {})
    q = KVQuantization(4, 32)
    x = mx.random.normal((2, 2, 1, 64)).astype(mx.bfloat16)
    want = kernels._quantize_with_ops(x, -x, q)

    monkeypatch.setattr(kernels, "_launch", exact)
    got = kernels.quantize_step(x, -x, q)
    assert launched == ["quantize", "quantize"]  # the check, then the step
    got = kernels.quantize_step(x, -x, q)
    assert launched == ["quantize"] * 3  # checked once
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    kernels.dequantize_pair(want[0], want[1], 64, 64, mx.bfloat16, q)
    assert launched[3:] == ["dequantize", "dequantize"]

    launched.clear()
    monkeypatch.setattr(kernels, "_launch", off)
    for dtype in (mx.float16, mx.float32):  # new combinations: checked, refused
        y = x.astype(dtype)
        got = kernels.quantize_step(y, -y, q)
        ops = kernels._quantize_with_ops(y, -y, q)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, ops, strict=True))
        pair = kernels.dequantize_pair(ops[0], ops[1], 64, 64, dtype, q)
        assert all(mx.array_equal(a, b).item() for a, b in zip(pair, ops[2:], strict=True))
    assert launched == ["quantize", "dequantize"] * 2  # the checks only

    def broken(*args: Any) -> list[mx.array]:
        raise RuntimeError("Failed to compile kernel")  # as MLX says it

    monkeypatch.setattr(kernels, "_launch", broken)
    z = mx.random.normal((1, 2, 1, 128))
    got = kernels.quantize_step(z, z, q)  # checked, failed, MLX's ops
    ops = kernels._quantize_with_ops(z, z, q)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ops, strict=True))
    launched.clear()
    kernels.quantize_step(x[0], -x[0], q)  # not [batch, heads, tokens, dim]
    with pytest.raises(ValueError, match="divisible"):  # MLX's error, not a kernel's guess
        kernels.quantize_step(mx.zeros((1, 1, 1, 48)), mx.zeros((1, 1, 1, 48)), q)
    assert launched == []


@pytest.mark.parametrize(("family", "anyio_backend"), [("llama", "asyncio"), ("gemma3", "trio")])
@pytest.mark.anyio
async def test_global_layers_attend_dequantized_where_quantized_attention_cannot_run(
    wide: Loaded,
    gemma: Loaded,
    family: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where mlx-lm's quantized attention cannot run (MLX's CUDA backend), global layers
    hand the model their keys and values dequantized. Made to take that path here:
    replies equal mlx-lm's through caches fed every key and value after ``mx.quantize``
    and ``mx.dequantize``, alone, batched, evicted and after a restart."""
    monkeypatch.setattr(_quantized, "quantized_attention_runs", lambda: False)
    model = wide if family == "llama" else gemma
    eos = model.tokenizer.eos_token_ids if family == "gemma3" else EOS

    def round_trip_cache() -> list[Any]:
        return [
            RoundTripKVCache(4) if type(c) is KVCache else RoundTripRotatingKVCache(c.max_size, 4)
            for c in make_prompt_cache(model.model)
        ]

    chats: dict[str, ReferenceChat] = {}

    async def converse(agent: Any, texts: list[str]) -> None:
        chat = chats.setdefault(agent.name, ReferenceChat(model.model, eos, round_trip_cache))
        for text in texts:
            reply = await agent.ask(text)
            prompt = render(model.tokenizer, list(agent.history)[:-1])
            assert list(reply.tokens) == chat.turn(prompt, 24), (agent.name, text)

    trace = tmp_path / "trace.jsonl"
    options: dict[str, Any] = dict(
        pool_blocks=14,
        log_level="off",
        kv_bits=4,
        kv_group_size=32,
        state_dir=tmp_path / "state",
    )
    turns = ["Hello there, how are you today?", "Tell me about the sea." + " waves" * 30]
    async with Runtime(model.path, trace=trace, **options) as rt:
        agents = [
            await rt.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=24) for i in range(4)
        ]
        await converse(agents[0], turns)  # alone
        await gather(*(converse(a, turns) for a in agents[1:]))  # batched
        stats = await rt.stats()
        assert stats.max_batch_size >= 2 and stats.evictions > 0 and stats.restores > 0
    started = [
        e
        for e in map(json.loads, trace.read_text().splitlines())
        if e["event"] == "scheduler.started"
    ]
    assert started[0]["kv_bits"] == 4 and started[0]["kv_attention"] == "dequantized"
    async with Runtime(model.path, **options) as rt:
        await converse(rt.agent("a1"), ["After the restart?"])


def test_quantized_attention_is_kept_where_it_runs() -> None:
    """On the CPU (and Apple silicon) global layers keep mlx-lm's quantized attention."""
    assert _quantized.quantized_attention_runs()
    assert KVQuantization(8).resolved().dequantize is False
    assert KVQuantization(8, dequantize=True).resolved().dequantize is True
