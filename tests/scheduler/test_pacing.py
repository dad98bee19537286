"""Prefill pacing: a step runs as many prompt tokens as the measured rate fits in its
target time, so a cancel or a new turn never waits long, and outputs do not change."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine
from mlx_actors.scheduler.engine import Pacing, _buffers, chunk

from ..conftest import Loaded, ReferenceChat, reference, run_to_completion
from .test_engine import prompt

N = 12


def test_the_budget_follows_the_measured_rate() -> None:
    pacing = Pacing(0.5, floor=8, ceiling=4096, start=128)
    assert pacing.budget() == 128  # nothing measured yet
    pacing.record(100, 2.5)  # over the target: perhaps a kernel compiling, no change
    assert pacing.budget() == 128
    pacing.record(100, 2.5)  # twice in a row: down to what fits (20 tokens)
    assert pacing.budget() == 16  # a power of two: few distinct chunk lengths
    pacing.record(16, 0.016)  # within the target, the whole budget: 500 tokens fit
    assert pacing.budget() == 256
    pacing.record(200, 0.45)  # slower, but within the target: at least four times
    assert pacing.budget() == 1024
    pacing.record(20, 0.001)  # a small chunk that ran fast says nothing
    assert pacing.budget() == 1024
    pacing.record(1024, 0.6)  # over once
    pacing.record(20, 0.01)  # then within: the slow one was a moment
    pacing.record(1024, 0.6)
    assert pacing.budget() == 1024
    pacing.record(1024, 0.001)
    assert pacing.budget() == 4096  # the ceiling
    pacing.record(0, 1.0)  # nothing to learn from
    assert pacing.budget() == 4096


def test_a_calibrated_engine_prefills_its_first_prompts_whole(tiny: Loaded) -> None:
    """Measured before the first turn (as on a GPU, where the runtime does it at start),
    the rate sets the budget: four prompts asked together are prefilled in the first
    step, whole, where the cautious start budget (128 tokens) would cut them into
    chunks; and the replies are mlx-lm's."""
    pool = BlockPool(tiny.spec, total_blocks=400)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool)
    assert engine.pacing.budget() == engine.pacing.start
    budget = engine.calibrate_pacing()
    assert budget == engine.pacing.budget() >= 4 * engine.pacing.start
    prompts = [prompt(100 + 10 * i, 20 + i) for i in range(4)]
    uids = [engine.submit(f"a{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
    done = {r.uid: r for r in engine.step()}
    assert engine.last_step is not None
    # every prompt token but each last one, which starts the sequence's decoding
    assert engine.last_step.prefill_tokens == sum(len(p) - 1 for p in prompts)
    done.update(run_to_completion(engine))
    eos = tiny.tokenizer.eos_token_ids
    for uid, p in zip(uids, prompts, strict=True):
        assert list(done[uid].tokens) == reference(tiny.model, p, N, stop=eos)
        engine.release(done[uid].blocks)
    assert pool.used_blocks == 0
    engine.close()


def test_a_short_rest_of_a_prompt_goes_with_the_chunk_before_it() -> None:
    assert chunk(1024, 1043) == 1043  # 19 left over: not a call (and a shape) of its own
    assert chunk(1024, 1300) == 1024  # 276 left over: more than a quarter
    assert chunk(1024, 500) == 500
    assert chunk(16, 19) == 19 and chunk(16, 20) == 16


def test_slow_steps_prefill_in_small_chunks_and_outputs_do_not_change(tiny: Loaded) -> None:
    pool = BlockPool(tiny.spec, total_blocks=400)
    # a target no machine meets: every step runs the floor's worth of prompt tokens
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, step_seconds=1e-9)
    floor = engine.pacing.floor
    eos = tiny.tokenizer.eos_token_ids
    cases = [
        [prompt(700, 1)],  # alone, outside the batch
        [prompt(200, 2), prompt(150, 3), prompt(90, 4)],  # prefilled in the batch
        [prompt(1500, 5)],  # a prefill job
    ]
    for prompts in cases:
        uids = [engine.submit(f"a{i}", p, max_tokens=N) for i, p in enumerate(prompts)]
        done, steps, jobs = {}, [], []
        while engine.active:
            for r in engine.step():
                done[r.uid] = r
            assert engine.last_step is not None
            steps.append(engine.last_step.prefill_tokens)
            jobs.append(engine.last_step.jobs)
        # the start's budget until two steps ran long, then the floor; and each
        # sequence's last prompt token as it starts decoding
        # (a step takes a short rest of a prompt with it: up to a quarter more)
        assert max(steps[:2]) <= engine.pacing.start * 5 // 4 + len(prompts)
        assert max(steps[2:]) <= floor * 5 // 4 + len(prompts)
        assert sum(steps) == sum(len(p) for p in prompts)
        # one prefill job at a time, and only for the long prompt
        assert max(jobs) == (1 if prompts is cases[2] else 0)
        for uid, p in zip(uids, prompts, strict=True):
            assert list(done[uid].tokens) == reference(tiny.model, p, N, stop=eos)
            engine.release(done[uid].blocks)
    assert pool.used_blocks == 0
    engine.close()


@pytest.mark.parametrize("length", [700, 1500])  # alone, outside the batch; a prefill job
def test_a_prefills_buffers_leave_mlxs_cache(
    tiny: Loaded, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's activations are of a shape seldom seen again: kept in MLX's buffer
    cache, they grew a CUDA device's memory until an allocation failed. While an engine
    runs, MLX keeps at most ``CACHE_BYTES`` there (here 1 MB; 10 to 28 MB stayed
    without a limit); once the last engine closes, the limit is as it was."""
    monkeypatch.setattr(_buffers, "CACHE_BYTES", 1 << 20)
    monkeypatch.setattr(_buffers, "_holders", 0)  # engines of other tests left open
    before = mx.set_cache_limit(64 << 20)  # the limit outside engines, for this test
    try:
        pool = BlockPool(tiny.spec, total_blocks=400)
        engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool)
        other = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool)
        engine.submit("a", prompt(length, 1), max_tokens=2)
        prefilled = 0
        while engine.active:
            engine.step()
            assert engine.last_step is not None
            prefilled += engine.last_step.prefill_tokens
            assert mx.get_cache_memory() <= 1 << 20
        assert prefilled == length
        engine.close()
        engine.close()  # closing twice gives the limit back once
        assert mx.set_cache_limit(1 << 20) == 1 << 20  # the other engine still runs
        other.close()
        assert mx.set_cache_limit(64 << 20) == 64 << 20
    finally:
        mx.set_cache_limit(before)


def test_a_batch_of_prompts_leaves_mlxs_cache_as_it_is(tiny: Loaded) -> None:
    """mlx-lm's ``BatchGenerator`` empties MLX's buffer cache after each chunk of its
    batch of prompts; inside an engine's step it leaves it (its buffers are the next
    steps'), and elsewhere mlx-lm's call empties it as before. Replies are mlx-lm's."""
    pool = BlockPool(tiny.spec, total_blocks=400)
    engine = BlockPoolBatchEngine(tiny.model, tiny.tokenizer, pool, step_seconds=60.0)
    eos = tiny.tokenizer.eos_token_ids
    chats = [ReferenceChat(tiny.model, eos) for _ in range(2)]
    histories = []
    for i, chat in enumerate(chats):  # each agent's first turn
        first = prompt(300 + 20 * i, 50 + i)
        uid = engine.submit(f"a{i}", first, max_tokens=2)
        result = run_to_completion(engine)[uid]
        assert list(result.tokens) == chat.turn(first, 2)
        histories.append(result.blocks)
    engine.submit("busy", prompt(40, 60), max_tokens=3 * N)
    engine.step()  # it decodes: the two questions join a busy batch as a batch of prompts
    questions = [prompt(20 + 5 * i, 70 + i) for i in range(2)]
    uids = [engine.submit(f"a{i}", q, histories[i], max_tokens=N) for i, q in enumerate(questions)]
    cached, done = [], {}
    while engine.active:
        for r in engine.step():
            done[r.uid] = r
        assert engine.last_step is not None
        if engine.last_step.prefill_tokens and not engine.last_step.jobs:
            cached.append(mx.get_cache_memory())  # after a step of the batch of prompts
    assert cached and min(cached) > 1 << 16  # emptied, a few hundred bytes were left
    for i, uid in enumerate(uids):
        history = [*histories[i].tokens, *questions[i]]
        assert list(done[uid].tokens) == chats[i].turn(history, N)
    _buffers._generate.mx.clear_cache()  # mlx-lm's call, outside an engine's step
    assert mx.get_cache_memory() == 0
    for r in done.values():
        engine.release(r.blocks)
    for blocks in histories:
        engine.release(blocks)
    engine.close()


@pytest.mark.parametrize("long_prefill", [32, 64])
def test_short_prefills_started_together_start_decoding_together(
    tiny: Loaded, long_prefill: int
) -> None:
    """Four agents with cached histories of different lengths ask a question of 40 to 61
    tokens at once. From ``long_prefill`` new tokens each is a prefill job (one model call
    each), else the four are one batch of prompts (one model call for all, their caches
    padded to the longest); either way their first tokens come out of one step, and each
    reply is mlx-lm's own on its agent's conversation."""
    pool = BlockPool(tiny.spec, total_blocks=400)
    jobs_run = long_prefill == 32
    # Jobs: every step's budget is the floor (16 tokens), less than any of these prompts:
    # paced alone, each prefill would take steps of its own, but a gang runs in one step.
    # A batch of prompts runs whole when the step's budget holds them all.
    engine = BlockPoolBatchEngine(
        tiny.model,
        tiny.tokenizer,
        pool,
        step_seconds=1e-9 if jobs_run else 60.0,
        long_prefill=long_prefill,
    )
    eos = tiny.tokenizer.eos_token_ids
    chats = [ReferenceChat(tiny.model, eos) for _ in range(4)]
    histories = []
    for i, chat in enumerate(chats):  # each agent's first turn, alone
        first = prompt(200 + 37 * i, 30 + i)
        uid = engine.submit(f"a{i}", first, max_tokens=8)
        result = run_to_completion(engine)[uid]
        assert list(result.tokens) == chat.turn(first, 8)
        histories.append(result.blocks)
    if not jobs_run:
        engine.pacing.tokens = 4096  # as measured on a fast machine
    steps = 0
    first_token_at: dict[int, int] = {}
    questions = [prompt(40 + 7 * i, 40 + i) for i in range(4)]
    uids = [
        engine.submit(
            f"a{i}",
            question,
            histories[i],
            max_tokens=N,
            on_token=lambda event: first_token_at.setdefault(event.uid, steps),
        )
        for i, question in enumerate(questions)
    ]
    done = {}
    jobs, prefills = [], []
    while engine.active:
        steps += 1
        for r in engine.step():
            done[r.uid] = r
        assert engine.last_step is not None
        jobs.append(engine.last_step.jobs)
        prefills.append(engine.last_step.prefill_tokens)
    # All four in one step (as jobs, or as one batch of prompts): their first tokens come
    # out of one step.
    assert max(jobs) == (4 if jobs_run else 0)
    assert max(prefills) >= sum(len(q) - 1 for q in questions)
    assert len({first_token_at[uid] for uid in uids}) == 1
    for i, uid in enumerate(uids):
        history = [*histories[i].tokens, *questions[i]]
        assert list(done[uid].tokens) == chats[i].turn(history, N)
        engine.release(histories[i])
        engine.release(done[uid].blocks)
    assert pool.used_blocks == 0
    engine.close()
