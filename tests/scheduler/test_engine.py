"""The block-pool batch engine against mlx-lm's own generation, on a tiny real model."""

from __future__ import annotations

import random
import time

import pytest

from mlx_actors.errors import (
    CacheReconstructionError,
    ContextLengthError,
    InvalidRequestError,
    PoolExhaustedError,
)
from mlx_actors.scheduler import (
    BLOCK_SIZE,
    AgentBlocks,
    BlockPool,
    BlockPoolBatchEngine,
    Sampling,
)

from ..conftest import Loaded, ReferenceChat, reference, run_to_completion

N = 24


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# under one block, exactly one block, several blocks
PROMPTS = [prompt(40, 1), prompt(BLOCK_SIZE, 2), prompt(3 * BLOCK_SIZE + 77, 3)]


@pytest.fixture(scope="module")
def references(tiny: Loaded) -> list[list[int]]:
    return [reference(tiny.model, p, N, stop=tiny.tokenizer.eos_token_ids) for p in PROMPTS]


@pytest.mark.parametrize(
    "which", [[0], [1], [2], [0, 1, 2]], ids=["short", "one-block", "long", "batched"]
)
def test_greedy_output_matches_mlx_lm(
    engine: BlockPoolBatchEngine, references: list[list[int]], which: list[int]
) -> None:
    uids = {engine.submit(f"a{i}", PROMPTS[i], max_tokens=N): i for i in which}
    done = run_to_completion(engine)
    assert {uid: list(done[uid].tokens) for uid in uids} == {
        uid: references[i] for uid, i in uids.items()
    }
    for uid, i in uids.items():
        result = done[uid]
        assert result.usage.prompt_tokens == len(PROMPTS[i])
        assert result.usage.cached_tokens == 0
        assert result.usage.generated_tokens == len(references[i])
        assert result.blocks.tokens == (*PROMPTS[i], *references[i])
        assert result.agent_id == f"a{i}"


def test_resume_from_blocks_matches_persistent_cache(
    tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    chat = ReferenceChat(tiny.model, eos)
    history: list[int] = []
    blocks = None
    # turn lengths chosen so the history crosses block boundaries mid-prompt and mid-reply
    for turn, (n_new, n_out) in enumerate([(200, 40), (100, 30), (300, 20), (5, 25)]):
        new = prompt(n_new, 100 + turn)
        expected = chat.turn([*history, *new], n_out)
        uid = engine.submit("agent", new, blocks, max_tokens=n_out)
        result = run_to_completion(engine)[uid]
        assert list(result.tokens) == expected, f"turn {turn}"
        assert result.usage.cached_tokens == len(history)
        assert result.usage.prompt_tokens == n_new
        engine.release(blocks)
        blocks = result.blocks
        history = [*history, *new, *expected]
        assert blocks.tokens == tuple(history)
    engine.release(blocks)
    assert engine.pool.used_blocks == 0


def test_trim_rewinds_the_cache(tiny: Loaded, engine: BlockPoolBatchEngine) -> None:
    first = prompt(300, 7)
    uid = engine.submit("a", first, max_tokens=10)
    blocks = run_to_completion(engine)[uid].blocks
    # the history diverges 50 tokens back: trim and continue from there
    rewritten = [*blocks.tokens[:-50], *prompt(30, 8)]
    common = blocks.common_prefix(rewritten)
    assert common == blocks.num_tokens - 50
    uid = engine.submit("a", rewritten[common:], blocks, trim=50, max_tokens=N)
    result = run_to_completion(engine)[uid]
    fresh = reference(tiny.model, rewritten, N, stop=tiny.tokenizer.eos_token_ids)
    assert list(result.tokens) == fresh
    assert result.usage.cached_tokens == common
    engine.release(blocks)
    engine.release(result.blocks)


def test_continuous_batching(engine: BlockPoolBatchEngine, tiny: Loaded) -> None:
    eos = tiny.tokenizer.eos_token_ids
    jobs = [(prompt(30 + 40 * i, 20 + i), 5 + 7 * i) for i in range(6)]
    expected = [reference(tiny.model, p, n, stop=eos) for p, n in jobs]
    uids = {
        engine.submit("x", jobs[0][0], max_tokens=jobs[0][1]): 0,
        engine.submit("x", jobs[1][0], max_tokens=jobs[1][1]): 1,
    }
    done = {}
    steps = 0
    while engine.active or len(uids) < len(jobs):
        # new sequences join while the first ones are mid-decode
        if steps in (3, 6, 9, 12) and len(uids) < len(jobs):
            i = len(uids)
            uids[engine.submit("x", jobs[i][0], max_tokens=jobs[i][1])] = i
        for r in engine.step():
            done[r.uid] = r
        steps += 1
    assert {uids[u]: list(r.tokens) for u, r in done.items()} == dict(enumerate(expected))
    assert engine.statistics().max_decode_batch > 2


def test_streamed_pieces_add_up_and_stop_strings_cut(
    tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    text = "Tell me a story about a tiny llama."
    ids = tiny.tokenizer.encode(text)
    expected = reference(tiny.model, ids, 60, stop=tiny.tokenizer.eos_token_ids)
    full = tiny.tokenizer.decode(expected)
    # a stop string that first occurs well inside the reference's text
    stop = next(
        full[i : i + 3] for i in range(10, len(full) - 3) if full.find(full[i : i + 3]) == i
    )
    events = []
    uid = engine.submit("a", text, max_tokens=60, stop=[stop], on_token=events.append)
    result = run_to_completion(engine)[uid]
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert "".join(e.text for e in events) == result.text
    assert [e.token for e in events] == list(result.tokens)
    assert list(result.tokens) == expected[: len(result.tokens)]
    # the cache holds exactly the tokens generated, so the next turn can continue
    assert result.blocks.tokens == (*ids, *result.tokens)
    engine.release(result.blocks)


def test_end_of_sequence_token_stops_and_is_not_text(tiny_dir, pool: BlockPool) -> None:
    from ..conftest import load

    fresh = load(tiny_dir)  # its own tokenizer: the test changes the eos set
    ids = prompt(50, 9)
    expected = reference(fresh.model, ids, 30)
    eos = expected[11]
    fresh.tokenizer.eos_token_ids = {eos}
    engine = BlockPoolBatchEngine(
        fresh.model, fresh.tokenizer, BlockPool(fresh.spec, total_blocks=50)
    )
    uid = engine.submit("a", ids, max_tokens=30)
    result = run_to_completion(engine)[uid]
    cut = expected.index(eos) + 1
    assert list(result.tokens) == expected[:cut]
    assert result.finish_reason == "stop"
    assert result.text == fresh.tokenizer.decode(expected[: cut - 1])


def test_length_finish_and_timings(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit("a", prompt(20, 3), max_tokens=3)
    result = run_to_completion(engine)[uid]
    assert result.finish_reason in ("length", "stop")
    assert 0 < result.ttft_s <= result.total_s


def test_cancel_frees_the_reservation_and_keeps_the_old_blocks(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    uid = engine.submit("a", prompt(100, 4), max_tokens=10)
    blocks = run_to_completion(engine)[uid].blocks
    held = engine.pool.used_blocks
    uid = engine.submit("a", prompt(600, 5), blocks, max_tokens=50)
    engine.step()
    engine.step()
    assert engine.pool.statistics().reserved_blocks > 0
    assert engine.cancel(uid)
    assert not engine.cancel(uid)
    stats = engine.pool.statistics()
    assert (stats.used_blocks, stats.reserved_blocks) == (held, 0)
    # the agent continues from the blocks it had, as if the cancelled turn never ran
    nxt = prompt(10, 6)
    uid = engine.submit("a", nxt, blocks, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == reference(
        tiny.model, [*blocks.tokens, *nxt], N, stop=tiny.tokenizer.eos_token_ids
    )
    engine.release(blocks)
    engine.release(result.blocks)
    assert engine.pool.used_blocks == 0


def test_unchanged_full_blocks_are_shared_not_copied(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit("a", prompt(3 * BLOCK_SIZE + 10, 11), max_tokens=4)
    first = run_to_completion(engine)[uid].blocks
    uid = engine.submit("a", prompt(20, 12), first, max_tokens=4)
    second = run_to_completion(engine)[uid].blocks
    for old, new in zip(first.layers, second.layers):
        assert new[:3] == old[:3]  # the same KVBlock objects
        assert all(engine.pool.references(b) == 2 for b in new[:3])
        assert new[3] is not old[3]  # the partial block was rewritten
    engine.release(first)
    assert all(engine.pool.references(b) == 1 for b in second.blocks())
    engine.release(second)
    assert engine.pool.used_blocks == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": []}, "no tokens"),
        ({"prompt": ""}, "empty"),
        ({"prompt": [1, 2, 100000]}, "outside the vocabulary"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": [1, 2], "trim": 1}, "trim"),
        ({"prompt": [1, 2], "stop": [""]}, "stop"),
        ({"prompt": [1, 2], "sampling": "hot"}, None),
        ({"prompt": [1] * 5000}, "context"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(
    engine: BlockPoolBatchEngine, kwargs: dict, match: str | None, tiny: Loaded
) -> None:
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises((InvalidRequestError, AttributeError)) as info:
        engine.submit("a", **kwargs)
    if match is not None:
        assert issubclass(info.type, InvalidRequestError)
        assert match in str(info.value)
    assert engine.active == 0
    assert engine.pool.statistics().reserved_blocks == 0
    # still usable
    uid = engine.submit("a", PROMPTS[0], max_tokens=5)
    assert list(run_to_completion(engine)[uid].tokens) == reference(
        tiny.model, PROMPTS[0], 5, stop=tiny.tokenizer.eos_token_ids
    )


def test_sampling_settings_are_checked() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"seed": "x"}):
        with pytest.raises(InvalidRequestError):
            Sampling(**bad)


def test_pool_limits(tiny: Loaded) -> None:
    small = BlockPool(tiny.spec, total_blocks=3 * 3)  # three blocks per layer
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, small)
    with pytest.raises(ContextLengthError, match="whole pool"):
        engine.submit("a", prompt(3 * BLOCK_SIZE, 1), max_tokens=10)
    uid = engine.submit("a", prompt(2 * BLOCK_SIZE, 1), max_tokens=10)  # takes all 9
    with pytest.raises(PoolExhaustedError) as info:
        engine.submit("b", prompt(10, 2), max_tokens=10)
    assert (info.value.needed, info.value.free) == (3, 0)
    assert "needs 3 free blocks but has 0" in str(info.value)
    result = run_to_completion(engine)[uid]
    engine.release(result.blocks)
    uid = engine.submit("b", prompt(10, 2), max_tokens=10)
    engine.release(run_to_completion(engine)[uid].blocks)
    assert small.used_blocks == 0


def test_blocks_of_another_model_or_freed_blocks_are_refused(
    tmp_path, tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    from mlx_actors.testing import tiny_config, write_random_model

    from ..conftest import load

    other = load(write_random_model(tmp_path / "other", tiny_config(num_hidden_layers=2)))
    other_engine = BlockPoolBatchEngine(
        other.model, other.tokenizer, BlockPool(other.spec, total_blocks=20)
    )
    uid = other_engine.submit("a", prompt(30, 1), max_tokens=3)
    foreign = run_to_completion(other_engine)[uid].blocks
    with pytest.raises(CacheReconstructionError, match="layers"):
        engine.submit("a", [1, 2], foreign, max_tokens=3)

    uid = engine.submit("a", prompt(30, 1), max_tokens=3)
    blocks = run_to_completion(engine)[uid].blocks
    engine.release(blocks)
    with pytest.raises(CacheReconstructionError, match="not a live block"):
        engine.submit("a", [1, 2], blocks, max_tokens=3)
    assert engine.active == 0 and engine.pool.used_blocks == 0


def test_no_leaks_after_a_mixed_workload(tiny: Loaded) -> None:
    pool = BlockPool(tiny.spec, total_blocks=90)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, max_batch_size=4)
    rng = random.Random(5)
    agents = [f"agent{i}" for i in range(6)]
    live: dict[str, AgentBlocks] = {}  # agent -> its current blocks
    in_flight: dict[int, str] = {}
    outcomes = {"finished": 0, "cancelled": 0, "refused": 0, "exhausted": 0}

    def collect(results) -> None:
        for result in results:
            owner = in_flight.pop(result.uid)
            engine.release(live.get(owner))
            live[owner] = result.blocks
            outcomes["finished"] += 1

    kinds = ["fresh", "resume", "bad", "resume", "huge", "resume", "cancel"]
    for i in range(42):
        while len(in_flight) == len(agents):
            collect(engine.step())
        agent = rng.choice([a for a in agents if a not in in_flight.values()])
        kind = kinds[i % len(kinds)]
        cache = live.get(agent) if kind in ("resume", "cancel") else None
        try:
            if kind == "bad":
                engine.submit(agent, [], cache)
            elif kind == "huge":  # more than is free while others run
                in_flight[engine.submit(agent, prompt(2900, i), max_tokens=100)] = agent
            else:
                uid = engine.submit(
                    agent, prompt(rng.randrange(5, 300), i), cache, max_tokens=rng.randrange(1, 40)
                )
                in_flight[uid] = agent
                if kind == "cancel":
                    collect(engine.step())  # a lone turn may finish in its first step
                    if uid in in_flight:
                        assert engine.cancel(uid)
                        del in_flight[uid]
                        outcomes["cancelled"] += 1
        except InvalidRequestError:
            outcomes["refused"] += 1
        except PoolExhaustedError:
            outcomes["exhausted"] += 1
        for _ in range(rng.randrange(1, 8)):
            collect(engine.step())
    collect(run_to_completion(engine).values())
    assert outcomes["finished"] >= 20 and all(outcomes.values()), outcomes
    held = {id(b) for blocks in live.values() for b in blocks.blocks()}
    stats = pool.statistics()
    assert stats.used_blocks == len(held)
    assert stats.reserved_blocks == 0
    for blocks in live.values():
        engine.release(blocks)
    assert pool.statistics().used_blocks == 0


class Faulty:
    """The real tiny model with faults that can be switched on: ``armed`` makes its next
    forward pass raise (as a real MLX error or running out of memory would), ``fail_in``
    the pass after that many more (set from another thread, it still lands in the turn
    it counts in), ``delay``
    makes every pass take that many seconds longer (as a bigger model would)."""

    def __init__(self, model) -> None:
        self._model = model
        self.armed = False
        #: Passes to run before one fails (``None``: none fails this way).
        self.fail_in: int | None = None
        self.delay = 0.0

    def __call__(self, *args, **kwargs):
        if self.fail_in is not None:
            self.fail_in -= 1
            self.armed = self.armed or self.fail_in < 0
        if self.armed:
            self.armed, self.fail_in = False, None
            raise RuntimeError("injected fault")
        if self.delay:
            time.sleep(self.delay)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_failing_step_drops_its_sequences_and_the_engine_goes_on(tiny: Loaded) -> None:
    from mlx_actors.errors import EngineError

    model = Faulty(tiny.model)
    pool = BlockPool(tiny.spec, total_blocks=60)
    engine = BlockPoolBatchEngine(model, tiny.tokenizer, pool)
    first = engine.submit("a", prompt(50, 1), max_tokens=5)
    blocks = run_to_completion(engine)[first].blocks
    uids = {
        engine.submit("a", prompt(20, 2), blocks, max_tokens=20),
        engine.submit("b", prompt(30, 3), max_tokens=20),
    }
    engine.step()
    model.armed = True
    with pytest.raises(EngineError, match="injected fault") as info:
        engine.step()
    assert set(info.value.uids) == uids
    assert engine.active == 0
    stats = pool.statistics()
    assert (stats.used_blocks, stats.reserved_blocks) == (blocks.num_blocks, 0)
    # the old blocks are intact and the engine serves new work exactly
    nxt = prompt(15, 4)
    uid = engine.submit("a", nxt, blocks, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == reference(
        tiny.model, [*blocks.tokens, *nxt], N, stop=tiny.tokenizer.eos_token_ids
    )
