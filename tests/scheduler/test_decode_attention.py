"""A batch's decode attention from each row's first position: the attention function
mlx-lm's models call, routed through the batch cache (on a CUDA GPU, a kernel;
``benchmarks/decode_attention.py`` checks its bits there)."""

from __future__ import annotations

import random
import sys
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_actors import Runtime
from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine
from mlx_actors.scheduler.caches import _attention, _decode_kernel
from mlx_actors.scheduler.caches._global import GlobalBatchKVCache
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import INIT_SCALE, Loaded, asyncio_only, load, reference, render

anyio_backend = asyncio_only()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.fixture(scope="module")
def heads64(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """A tiny model with heads of 64 (a size MLX's vector attention takes)."""
    config = tiny_config(num_hidden_layers=2, head_dim=64)
    path = tmp_path_factory.mktemp("models") / "heads64"
    return load(write_random_model(path, config, seed=3, init_scale=INIT_SCALE))


def model_module(tiny: Loaded) -> Any:
    return sys.modules[type(tiny.model.layers[0].self_attn).__module__]


def test_batches_attending_from_row_starts_match_mlx_lm(
    heads64: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences of different lengths join and leave a decoding batch; every decode step
    attends through the batch cache over each row's span (here with MLX's attention on
    each row alone, which the CUDA kernel reproduces bit for bit): replies are mlx-lm's."""
    spans: list[tuple[list[int], list[int], int]] = []

    def by_rows(
        q: mx.array, k: mx.array, v: mx.array, starts: Any, lengths: Any, scale: float
    ) -> mx.array:
        spans.append((starts.tolist(), lengths.tolist(), int(k.shape[2])))
        return _decode_kernel.attend_with_ops(q, k, v, starts, lengths, scale)

    monkeypatch.setattr(_decode_kernel, "runs", lambda *args: True)  # as on a GPU
    monkeypatch.setattr(_decode_kernel, "attend", by_rows)
    tiny = heads64
    eos = tiny.tokenizer.eos_token_ids
    jobs = [(prompt(30 + 70 * i, 40 + i), 4 + 6 * i) for i in range(5)]
    expected = [reference(tiny.model, p, n, stop=eos) for p, n in jobs]
    pool = BlockPool(tiny.spec, total_blocks=400)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, max_batch_size=8)
    try:
        uids = {engine.submit("x", jobs[i][0], max_tokens=jobs[i][1]): i for i in (0, 1)}
        done, steps = {}, 0
        while engine.active or len(uids) < len(jobs):
            if steps in (2, 5, 8) and len(uids) < len(jobs):  # join mid-decode
                i = len(uids)
                uids[engine.submit("x", jobs[i][0], max_tokens=jobs[i][1])] = i
            for r in engine.step():
                done[r.uid] = r
            steps += 1
    finally:
        engine.close()
    assert {uids[u]: list(r.tokens) for u, r in done.items()} == dict(enumerate(expected))
    padded = [s for s in spans if len(set(s[0])) > 1]  # rows starting apart
    assert padded, "no batch of rows of different lengths attended through the cache"
    for starts, lengths, tokens in spans:
        assert all(s + n == tokens for s, n in zip(starts, lengths, strict=True))


@pytest.mark.anyio
@pytest.mark.parametrize("decode_kernel", [True, False])
async def test_without_the_decode_kernel_a_batch_attends_as_mlx_lms_batch_generator(
    heads64: Loaded, monkeypatch: pytest.MonkeyPatch, decode_kernel: bool
) -> None:
    """Three agents asked at once decode as one batch. By default each decoding step's
    attention goes through the batch cache (by rows, as the kernel attends on a GPU);
    with ``Runtime(decode_kernel=False)`` none does: mlx-lm's masked attention runs, as
    in its ``BatchGenerator``. The replies are mlx-lm's either way."""
    rows: list[int] = []

    def by_rows(
        q: mx.array, k: mx.array, v: mx.array, starts: Any, lengths: Any, scale: float
    ) -> mx.array:
        rows.append(int(q.shape[0]))
        return _decode_kernel.attend_with_ops(q, k, v, starts, lengths, scale)

    monkeypatch.setattr(_decode_kernel, "runs", lambda *args: True)  # as on a GPU
    monkeypatch.setattr(_decode_kernel, "attend", by_rows)
    asks = ["Hello there.", "Tell me about the sea and its tides.", "Why?"]
    async with Runtime(
        heads64.path,
        pool_blocks=400,
        log_level="off",
        admission_window=1.0,  # the three turns start as one batch
        decode_kernel=decode_kernel,
    ) as rt:
        agents = [await rt.spawn(f"a{i}", system="Be brief.", max_tokens=12) for i in range(3)]
        replies: dict[int, Any] = {}

        async def ask(i: int) -> None:
            replies[i] = await agents[i].ask(asks[i])

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(ask, i)
        together = (await rt.stats()).max_batch_size
    eos = heads64.tokenizer.eos_token_ids
    for i, text in enumerate(asks):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        want = reference(heads64.model, render(heads64.tokenizer, messages), 12, stop=eos)
        assert list(replies[i].tokens) == want
    assert together == 3
    assert (max(rows, default=0) >= 2) is decode_kernel


def test_mlx_lms_caches_keep_mlx_lms_attention(tiny: Loaded) -> None:
    """Once installed, the models' attention function answers mlx-lm's own caches (and
    ours where they decline) with mlx-lm's function, bit for bit; installing twice
    changes nothing."""
    module = model_module(tiny)
    tokens = mx.array([prompt(37, 1), prompt(37, 2)])

    def logits(cache_type: Any) -> mx.array:
        cache = [cache_type([3, 0]) for _ in tiny.model.layers]
        first = tiny.model(tokens, cache=cache)
        nxt = tiny.model(mx.argmax(first[:, -1:], axis=-1), cache=cache)  # a decode step
        mx.eval(first, nxt)
        return mx.concatenate([first[:, -1], nxt[:, -1]])

    module.scaled_dot_product_attention = base.scaled_dot_product_attention
    try:
        want = {t: logits(t) for t in (BatchKVCache, GlobalBatchKVCache)}
        _attention.install(tiny.model)
        _attention.install(tiny.model)
        assert module.scaled_dot_product_attention is _attention.attention
        for t, w in want.items():
            assert mx.array_equal(logits(t), w).item(), t
        single = [KVCache() for _ in tiny.model.layers]
        mx.eval(tiny.model(tokens[:1], cache=single))  # a model's own cache still works
    finally:
        _attention.install(tiny.model)  # left as engines leave it
