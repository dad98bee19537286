"""Prefill pacing: a step runs as many prompt tokens as the measured rate fits in its
target time, so a cancel or a new turn never waits long, and outputs do not change."""

from __future__ import annotations

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine
from mlx_actors.scheduler._pacing import Pacing

from .conftest import Loaded, reference
from .test_engine import prompt

N = 12


def test_the_budget_follows_the_measured_rate() -> None:
    pacing = Pacing(0.5, floor=10, ceiling=1000, start=100)
    assert pacing.budget() == 100  # nothing measured yet
    pacing.record(50, 0.5)  # 10 ms a token: 50 tokens in half a second
    assert pacing.budget() == 50
    pacing.record(100, 0.1)  # faster news moves the average a quarter of the way
    assert pacing.seconds_per_token is not None and 0.0075 < pacing.seconds_per_token < 0.008
    pacing.record(10, 1.0)  # slower news counts at once
    assert pacing.budget() == 10  # the floor
    for _ in range(60):
        pacing.record(1000, 0.001)
    assert pacing.budget() == 1000  # the ceiling
    pacing.record(0, 1.0)  # nothing to learn from
    assert pacing.budget() == 1000


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
        done, steps = {}, []
        while engine.active:
            for r in engine.step():
                done[r.uid] = r
            assert engine.last_step is not None
            steps.append(engine.last_step.prefill_tokens)
        # the floor, and each sequence's last prompt token as it starts decoding
        assert max(steps) <= floor + len(prompts)
        assert sum(steps) == sum(len(p) for p in prompts)
        for uid, p in zip(uids, prompts, strict=True):
            assert list(done[uid].tokens) == reference(tiny.model, p, N, stop=eos)
            engine.release(done[uid].blocks)
    assert pool.used_blocks == 0
    engine.close()
