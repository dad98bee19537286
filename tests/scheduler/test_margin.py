"""The sliding-window margin (``scheduler/caches/_margin.py``) against a plain prefill: every
token the rotating caches keep aside, at the position it claims, holds the keys and values
mlx-lm computes there, in the batch states ``BatchGenerator`` puts them through."""

from __future__ import annotations

import gc
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_actors.scheduler import BlockPool
from mlx_actors.scheduler.caches import MarginBatchRotatingKVCache
from mlx_actors.scheduler.kv import PrefixIndex, evaluate, from_cache, make_cache, to_cache
from mlx_actors.testing import family_configs, write_random_model

from ..conftest import Loaded, load

WINDOW = 24


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("margin") / "gemma"
    return load(write_random_model(path, family_configs(WINDOW)["gemma3_text"], seed=11))


def kept_against_prefill(model: Loaded, cache: list[Any], tokens: list[int]) -> list[str]:
    """Where the kept tokens of ``cache`` (the cache of ``tokens``) differ from a plain
    prefill's keys and values at the positions they claim."""
    plain = make_prompt_cache(model.model)
    model.model(mx.array(tokens)[None], cache=plain)
    wrong = []
    for i, layer in enumerate(model.spec.layers):
        if layer.window is None:
            continue
        full = (plain[i].keys, plain[i].values)
        for d in cache[i].dropped:
            n = int(d.keys.shape[2])
            for got, want in zip((d.keys, d.values), full, strict=True):
                want = want[..., d.start : d.start + n, :]
                if d.start < 0 or not mx.allclose(got, want, atol=1e-4, rtol=1e-4).item():
                    wrong.append(f"layer {i} [{d.start}, {d.start + n})")
    return wrong


def test_a_row_joining_a_longer_prefill_keeps_no_padding_as_tokens(gemma: Loaded) -> None:
    """A 77-token prompt prefilled in chunks of 64, joined at its second chunk by a
    25-token one: that chunk is right-padded for the first row, whose ring the first
    chunk already trimmed beyond its padding. mlx-lm's roll then brings the padding to
    the front of the ring, where the first copy aside took it for tokens 29 to 40 (which
    the prefill had dropped): a rebuild inside the margin computed wrong logits."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (77, 25)]
    gen = BatchGenerator(gemma.model, stop_tokens=set(), prefill_batch_size=2, prefill_step_size=64)
    uids = gen.insert(prompts[:1], max_tokens=[4], caches=[make_cache(gemma.spec)])
    gen.next()  # the long prompt's first chunk runs alone
    uids += gen.insert(prompts[1:], max_tokens=[4], caches=[make_cache(gemma.spec)])
    done: dict[int, Any] = {}
    while len(done) < 2:
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, r.all_tokens)
    gen.close()
    for uid in uids:
        cache, tokens = done[uid]
        assert kept_against_prefill(gemma, cache, tokens) == []
    cache, tokens = done[uids[0]]
    margin = cache[0].margin(0)
    assert margin is not None
    start = margin[0]
    pool = BlockPool(gemma.spec, total_blocks=100)
    blocks = from_cache(pool, cache, tokens, pool.reserve(50), index=PrefixIndex(gemma.spec))
    evaluate([blocks])
    want = gemma.model(mx.array(tokens)[None])[0]
    rebuilt = 0
    for at in range(start + WINDOW, len(tokens)):
        got = gemma.model(mx.array(tokens[at:])[None], cache=to_cache(gemma.spec, blocks, at))[0]
        assert mx.allclose(got, want[at:], atol=1e-4, rtol=1e-4).item(), at
        rebuilt += 1
    assert rebuilt > 0


@pytest.mark.parametrize("seed", range(4))
def test_what_rows_keep_through_staggered_batches_matches_a_prefill(
    gemma: Loaded, seed: int
) -> None:
    """Rows with prompts of different lengths join a batch at different steps, their
    prefills cut into chunks, decode past the window, leave, and some come back for a
    second turn on the cache they left with: every token kept aside is the prefill's."""
    rng = random.Random(seed)
    gen = BatchGenerator(
        gemma.model,
        stop_tokens=set(),
        prefill_batch_size=3,
        prefill_step_size=rng.choice([8, 16, 32]),
    )
    history: dict[int, list[int]] = {}
    finished: list[tuple[list[Any], list[int]]] = []

    def insert(before: list[int], prompt: list[int], cache: list[Any]) -> None:
        (uid,) = gen.insert([prompt], max_tokens=[rng.randrange(20, 80)], caches=[cache])
        history[uid] = before

    def step() -> None:
        for r in gen.next()[1]:
            if r.finish_reason is None:
                continue
            tokens = history[r.uid] + list(r.all_tokens)
            finished.append((r.prompt_cache, tokens))
            if len(history) < 7:  # a second turn on the cache it left with
                more = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
                insert(tokens, more, r.prompt_cache)

    for _ in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 80))]
        insert([], prompt, make_cache(gemma.spec))
        for _ in range(rng.randrange(0, 8)):
            step()
    while len(finished) < len(history):
        step()
    gen.close()
    assert [kept_against_prefill(gemma, c, t) for c, t in finished] == [[] for _ in finished]
    assert all(c[0].dropped for c, t in finished if len(t) > 3 * WINDOW)


def test_rows_copying_at_different_steps_keep_only_their_own_copies(gemma: Loaded) -> None:
    """Sixteen rows joining one step apart copy aside at sixteen different steps; what
    each keeps is a buffer of its own, so dropping the kept copies frees what their
    ``nbytes`` count (a view of the batch-wide copy pinned sixteen times that)."""
    gen = BatchGenerator(gemma.model, stop_tokens=set(), prefill_batch_size=1)
    for i in range(16):
        gen.insert([[1 + i, 2, 3]], max_tokens=[10_000], caches=[make_cache(gemma.spec)])
        gen.next()
    for _ in range(120):
        gen.next()
    batch = gen._generation_batch.prompt_cache
    caches = [c for c in batch if isinstance(c, MarginBatchRotatingKVCache)]
    mx.eval([c.state for c in caches])
    kept = sum(int(d.keys.nbytes + d.values.nbytes) for c in caches for r in c.rows for d in r)
    assert sum(c.nbytes for c in caches) == kept + sum(
        int(c.keys.nbytes + c.values.nbytes) for c in caches
    )
    gc.collect()
    before = mx.get_active_memory()
    for c in caches:
        c.rows = [[] for _ in c.rows]
    gc.collect()
    mx.eval(mx.zeros(1))
    freed = before - mx.get_active_memory()
    assert kept > 0
    assert freed <= 1.25 * kept
    gen.close()
