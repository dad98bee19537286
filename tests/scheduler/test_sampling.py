"""Sampling controls beyond temperature: penalties and a logit bias (mlx-lm's logits
processors), top-k and min-p, and per-token log-probabilities, through the engine, alone
and in the batch, against mlx-lm's ``generate_step`` given the same processors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_actors import Message, Runtime
from mlx_actors.actors import TurnOptions
from mlx_actors.errors import InvalidRequestError
from mlx_actors.runtime import _disk
from mlx_actors.scheduler import BlockPoolBatchEngine, Sampling

from ..conftest import Loaded, render, run_to_completion

FIRST_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop")

PROMPTS = [[1, 20, 30, 40, 50, 60], [1, 7, 8, 9], [1, 99, 98, 97, 96, 95, 94, 93, 92]]
PENALTIES: list[dict[str, Any]] = [
    {"repetition_penalty": 1.8, "repetition_context_size": 8},
    {"presence_penalty": 2.5},
    {"frequency_penalty": 1.5, "repetition_context_size": 30},
    {"logit_bias": {5: 3.0, 17: -2.0, 40: 1.5}},
]


def oracle(
    model: Any, tokens: list[int], n: int, eos: set[int], **settings: Any
) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy generation with the processors ``settings`` make, the whole
    sequence (history included) in their context."""
    size = settings.pop("repetition_context_size", 20)
    processors = make_logits_processors(
        **settings,
        **{f"{k}_context_size": size for k in ("repetition", "presence", "frequency")},
    )
    out: list[int] = []
    dists: list[mx.array] = []
    for token, logprobs in generate_step(
        mx.array(tokens), model, max_tokens=n, logits_processors=processors
    ):
        out.append(int(token))
        dists.append(logprobs)
        if token in eos:
            break
    return out, dists


@pytest.mark.parametrize("settings", PENALTIES, ids=lambda s: next(iter(s)))
def test_penalties_and_bias_match_mlx_lm_alone_batched_and_across_turns(
    engine: BlockPoolBatchEngine, tiny: Loaded, settings: dict[str, Any]
) -> None:
    eos = set(tiny.tokenizer.eos_token_ids)
    sampling = Sampling(**settings)
    # Alone (outside the batch), then joined by two plain sequences half-way.
    first = engine.submit("a", PROMPTS[0], max_tokens=24, sampling=sampling)
    for _ in range(6):
        engine.step()
    plain = [engine.submit(f"p{i}", p, max_tokens=16) for i, p in enumerate(PROMPTS[1:])]
    done = run_to_completion(engine)
    want, _ = oracle(tiny.model, PROMPTS[0], 24, eos, **settings)
    assert list(done[first].tokens) == want
    for uid, p in zip(plain, PROMPTS[1:]):  # neighbours are not changed
        assert list(done[uid].tokens) == oracle(tiny.model, p, 16, eos)[0]
    # A second turn on the first one's cache, in a batch: the processors read the
    # whole conversation, the history the cache holds included.
    history = [*PROMPTS[0], *done[first].tokens]
    more = [3, 4, 5, 6]
    second = engine.submit("a", more, done[first].blocks, max_tokens=20, sampling=sampling)
    other = engine.submit("b", PROMPTS[2], max_tokens=20, sampling=sampling)
    again = run_to_completion(engine)
    assert (
        list(again[second].tokens) == oracle(tiny.model, [*history, *more], 20, eos, **settings)[0]
    )
    assert list(again[other].tokens) == oracle(tiny.model, PROMPTS[2], 20, eos, **settings)[0]
    assert again[second].usage.cached_tokens > 0


def test_a_large_bias_decides_every_token(engine: BlockPoolBatchEngine, tiny: Loaded) -> None:
    uid = engine.submit("a", PROMPTS[1], max_tokens=12, sampling=Sampling(logit_bias={123: 1000.0}))
    assert list(run_to_completion(engine)[uid].tokens) == [123] * 12


def test_top_k_of_one_and_min_p_of_one_sample_only_the_most_likely_token(
    engine: BlockPoolBatchEngine, tiny: Loaded
) -> None:
    eos = set(tiny.tokenizer.eos_token_ids)
    greedy = oracle(tiny.model, PROMPTS[0], 16, eos)[0]
    uids = [
        engine.submit(
            f"s{i}", PROMPTS[0], max_tokens=16, sampling=Sampling(temperature=5.0, seed=i, **f)
        )
        for i, f in enumerate([{"top_k": 1}, {"min_p": 1.0}])
    ]
    loose = engine.submit("t", PROMPTS[0], max_tokens=16, sampling=Sampling(temperature=5.0))
    done = run_to_completion(engine)
    assert [list(done[u].tokens) for u in uids] == [greedy, greedy]
    assert list(done[loose].tokens) != greedy  # the filters, not the temperature, did it


@pytest.mark.parametrize("batched", [False, True])
def test_logprobs_are_mlx_lms_and_the_top_ones_come_sorted(
    engine: BlockPoolBatchEngine, tiny: Loaded, batched: bool
) -> None:
    eos = set(tiny.tokenizer.eos_token_ids)
    settings = {"repetition_penalty": 1.3}
    uid = engine.submit(
        "a", PROMPTS[2], max_tokens=10, sampling=Sampling(top_logprobs=4, **settings)
    )
    events: list[Any] = []
    quiet = (
        engine.submit("b", PROMPTS[1], max_tokens=10, on_token=events.append) if batched else None
    )
    done = run_to_completion(engine)
    result = done[uid]
    want, dists = oracle(tiny.model, PROMPTS[2], 10, eos, **settings)
    assert list(result.tokens) == want
    assert result.logprobs is not None and result.top_logprobs is not None
    assert len(result.logprobs) == len(result.top_logprobs) == len(want)
    for token, got, top, dist in zip(want, result.logprobs, result.top_logprobs, dists):
        assert got == pytest.approx(dist[token].item(), abs=1e-4)
        assert len(top) == 4 and top[0][0] == token  # greedy: the most likely
        assert [p for _, p in top] == sorted((p for _, p in top), reverse=True)
        best = mx.sort(dist)[::-1][:4].tolist()
        assert [p for _, p in top] == pytest.approx(best, abs=1e-4)
    if quiet is not None:  # a sequence that did not ask records nothing
        assert done[quiet].logprobs is None and done[quiet].top_logprobs is None
        assert all(e.logprob is None for e in events)


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": -1},
        {"min_p": 1.5},
        {"repetition_penalty": 0},
        {"repetition_context_size": 0},
        {"presence_penalty": float("nan")},
        {"logit_bias": {"a": 1.0}},
        {"logit_bias": {3: float("inf")}},
        {"logit_bias": [1, 2]},
        {"logprobs": 1},
        {"top_logprobs": 21},
    ],
)
def test_bad_sampling_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        Sampling(**bad)


def test_a_bias_outside_the_vocabulary_is_refused(engine: BlockPoolBatchEngine) -> None:
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.submit("a", [1, 2], max_tokens=3, sampling=Sampling(logit_bias={10**6: 1.0}))
    assert engine.active == 0


# -- through agents -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_agent_takes_the_settings_keeps_them_and_reports_logprobs(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path
) -> None:
    eos = set(tiny.tokenizer.eos_token_ids)
    state = tmp_path / "state"
    settings: dict[str, Any] = {"repetition_penalty": 1.5, "logit_bias": {7: 2.0, 9: -1.0}}
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=10, **settings)
        first = await ann.ask("Hello there", logprobs=True)
        tokens = render(tiny.tokenizer, [Message(role="user", content="Hello there")])
        want, dists = oracle(tiny.model, tokens, 10, eos, **settings)
        assert list(first.tokens) == want
        assert first.logprobs is not None and first.top_logprobs is None
        assert first.logprobs == pytest.approx([d[t].item() for t, d in zip(want, dists)], abs=1e-4)
        # Per turn, a setting overrides the agent's default and the rest stay.
        plain = await ann.ask("Again", repetition_penalty=1.0, logit_bias={})
        assert plain.logprobs is None
        with pytest.raises(InvalidRequestError, match="unknown settings"):
            await ann.ask("Typo", temprature=0.5)  # type: ignore[call-arg]
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off", state_dir=state) as rt:
        options = rt.agent("ann").options
        assert (options.repetition_penalty, options.logit_bias) == (1.5, ((7, 2.0), (9, -1.0)))


@pytest.mark.anyio
async def test_a_record_written_before_the_new_settings_still_loads(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off", state_dir=state) as rt:
        await (await rt.spawn("ann", max_tokens=4, temperature=0.5)).ask("Hi")
    record = state / "agents" / "ann.json"
    data = json.loads(record.read_text())
    data["options"] = {k: data["options"][k] for k in FIRST_OPTIONS}
    data.pop("sha256")
    record.write_text(json.dumps(_disk.with_digest(data)))
    async with Runtime(tiny_dir, pool_blocks=200, log_level="off", state_dir=state) as rt:
        assert rt.agent("ann").options == TurnOptions(max_tokens=4, temperature=0.5)
