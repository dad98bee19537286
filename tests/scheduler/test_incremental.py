"""A turn costs its new tokens, not its history: the prefix a turn starts from is found
from the agent's own blocks (the walk starts where their whole chunks end) and its cache
is cut keeping those blocks as they are, with the references the turn held. What this
finds, what the turn replies and what the pool holds are what the whole walk gives:
with shared briefs, forks and trimmed histories, on global and sliding-window models."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import pytest

from mlx_actors.scheduler import BLOCK_SIZE, AgentBlocks, BlockPool, BlockPoolBatchEngine
from mlx_actors.scheduler.kv import PrefixIndex
from mlx_actors.scheduler.kv._prefix import Source
from mlx_actors.testing import write_random_model

from ..conftest import Loaded, ReferenceChat, load, run_to_completion
from .test_engine import N, prompt
from .test_families import FAMILIES
from .test_sharing import held


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("incremental") / request.param
    scale = 1.0 if request.param == "gemma3_text" else 4.0
    return load(write_random_model(path, FAMILIES[request.param], seed=5, init_scale=scale))


class Checked:
    """The engine's index, each ``find`` given an agent's own blocks compared with the
    whole walk's (same length, path and positions per layer)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index, self.fast, self.compared = index, 0, 0
        self._find = index.find
        index.find = self.find  # type: ignore[method-assign]

    def find(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        limit: int,
        own: AgentBlocks | None = None,
        kept: int = 0,
    ) -> Source:
        got = self._find(namespace, tokens, limit, own, kept)
        if own is None or not kept:
            return got
        walked = self._find(namespace, tokens, limit)
        self.compared += 1
        self.fast += (
            self.index._find_after(namespace, tokens, min(kept, limit), limit, own) is not None
        )
        assert got.length == walked.length
        assert got.path == walked.path
        for mine, theirs in zip(got.layers, walked.layers, strict=True):
            assert [(b.start, b.end, a, z) for b, a, z in mine] == [
                (b.start, b.end, a, z) for b, a, z in theirs
            ]
        return got


def turns(
    engine: BlockPoolBatchEngine, asks: dict[str, tuple[AgentBlocks | None, list[int], int]]
) -> dict[str, Any]:
    """One round: each agent's (cache, new tokens, trim) submitted together; results."""
    uids = {
        engine.submit(name, new, cache, trim=trim, max_tokens=N): name
        for name, (cache, new, trim) in asks.items()
    }
    return {uids[uid]: result for uid, result in run_to_completion(engine).items()}


def test_turns_from_own_blocks_find_and_keep_what_the_whole_walk_does(model: Loaded) -> None:
    pool = BlockPool(model.spec, total_blocks=2000)
    engine = BlockPoolBatchEngine(model.model, model.tokenizer, pool, max_batch_size=8)
    checked = Checked(engine.index)
    eos = model.tokenizer.eos_token_ids
    brief = prompt(2 * BLOCK_SIZE + 100, 1)
    chats = {name: ReferenceChat(model.model, stop=eos) for name in ("ann", "bob")}
    caches: dict[str, AgentBlocks] = {}
    history: dict[str, list[int]] = {
        "ann": [*brief, *prompt(30, 2)],
        "bob": [*brief, *prompt(40, 3)],
    }
    try:
        for round_ in range(5):
            asks: dict[str, tuple[AgentBlocks | None, list[int], int]] = {}
            for i, name in enumerate(sorted(history)):
                cache = caches.get(name)
                trim = 0
                if cache is None:
                    new = history[name]
                else:
                    new = prompt(150 + 37 * i, 10 * round_ + i)
                    if name == "ann" and round_ == 3:  # a rewritten end: trimmed
                        trim = 20
                    history[name] = [*cache.tokens[: cache.num_tokens - trim], *new]
                asks[name] = (cache, new, trim)
            results = turns(engine, asks)
            for name, result in results.items():
                chat = chats.setdefault(name, ReferenceChat(model.model, stop=eos))
                assert list(result.tokens) == chat.turn(history[name], N), (name, round_)
                old = caches.get(name)
                caches[name] = result.blocks
                if old is not None:
                    engine.release(old)
            held(pool, *caches.values())
            if round_ == 1:  # a fork: ann's blocks, going on elsewhere
                caches["cal"] = engine.share(caches["ann"])
                history["cal"] = list(caches["cal"].tokens)
        assert checked.fast >= 8 and checked.compared >= checked.fast
    finally:
        for blocks in caches.values():
            engine.release(blocks)
        engine.close()
    assert pool.used_blocks == 0 and engine.index.nodes == 0
