"""Every turn reuses the whole history on sliding-window models too: when the re-rendered
conversation differs from the cache near its end (a stop string cut from the reply's text,
a template that trims, a reply that re-encodes differently), a Gemma 3 model prefills
only the tokens that differ, as Llama does, and its replies stay those of mlx-lm."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlx_actors import Runtime
from mlx_actors.scheduler import SLIDING_MARGIN, BlockPool, BlockPoolBatchEngine, LayerKind
from mlx_actors.testing import CHATML_TEMPLATE, family_configs, write_random_model

from ..conftest import Loaded, asyncio_only, load, reference, render, run_to_completion

# What these tests check does not depend on the event loop.
anyio_backend = asyncio_only()

#: The byte tokenizer's end of turn (``<|im_end|>``).
EOS = {258}
#: Gemma 3 trims every message; so does this template, on top of ChatML.
TRIM_TEMPLATE = CHATML_TEMPLATE.replace("message['content']", "message['content'] | trim")


def gemma(path: Path, window: int, template: str | None = None) -> Loaded:
    """A tiny Gemma 3 of one sliding-window layer and one global: what these tests check
    is per kind of layer, and two layers step three times faster than Gemma 3's six (the
    families' tests run its own pattern)."""
    config = {
        **family_configs(window)["gemma3_text"],
        "num_hidden_layers": 2,
        "sliding_window_pattern": 2,
    }
    write_random_model(path, config, seed=11, init_scale=1.0)
    if template is not None:
        settings = path / "tokenizer_config.json"
        data = json.loads(settings.read_text())
        data["chat_template"] = template
        settings.write_text(json.dumps(data))
    return load(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """Turns shorter than the window."""
    return gemma(tmp_path_factory.mktemp("reuse") / "wide", window=96)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """Turns longer than the window."""
    return gemma(tmp_path_factory.mktemp("reuse") / "narrow", window=24)


def rewritten_turns(
    model: Loaded, turns: int, new: int, reply: int, rewrite: Any, first: int = 0
) -> list[tuple[Any, list[int], list[int], int]]:
    """Turns of one agent through the engine; before each, ``rewrite(turn, n, rng)``
    gives how many of the history's last tokens the next rendering replaces (``n``: the
    last turn's new tokens, prompt and reply). Returns, per turn, the admission, the whole
    prompt, the reply, and where its new tokens begin."""
    pool = BlockPool(model.spec, total_blocks=200)
    engine = BlockPoolBatchEngine(model.model, model.tokenizer, pool)
    rng = random.Random(3)
    blocks, out, start = None, [], 0
    for turn in range(turns):
        fresh = [rng.randrange(256) for _ in range(first if first and not turn else new)]
        if blocks is None:
            prompt, keep = fresh, 0
        else:
            k = min(rewrite(len(out), blocks.num_tokens - start, rng), blocks.num_tokens - 1)
            keep = blocks.num_tokens - k
            edit = [rng.randrange(256) for _ in range(k)]
            prompt = [*blocks.tokens[:keep], *edit, *fresh]
            while prompt[keep] == blocks.tokens[keep]:
                prompt[keep] = (prompt[keep] + 1) % 256  # the rewrite starts at `keep`
        trim = blocks.num_tokens - keep if blocks is not None else 0
        uid = engine.submit("a", prompt[keep:], blocks, trim=trim, max_tokens=reply)
        admission = engine.admission(uid)
        result = run_to_completion(engine)[uid]
        out.append((admission, prompt, list(result.tokens), keep))
        engine.release(blocks)
        start, blocks = keep, result.blocks
        assert pool.used_blocks == blocks.num_blocks  # nothing else is held
    engine.release(blocks)
    assert pool.used_blocks == 0
    engine.close()
    return out


def test_a_rewrite_inside_the_last_turn_costs_only_what_differs(wide: Loaded) -> None:
    # Each turn (the rewritten tokens, 20 new ones and the reply) is shorter than the
    # window; the rewrite replaces 1 to all of the last turn's tokens.
    turns = rewritten_turns(
        wide, 14, new=20, reply=30, rewrite=lambda t, n, rng: rng.randint(1, min(n, 40))
    )
    for number, (admission, prompt, reply, keep) in enumerate(turns):
        assert admission.reusable_tokens == keep
        assert admission.cached_tokens == keep, number
        assert admission.prefill_tokens == len(prompt) - keep
        assert admission.not_reused is None
        assert reply == reference(wide.model, prompt, 30, stop=EOS), number
    assert len(turns[-1][1]) > 256 + 2 * 96  # several windows, across blocks


def test_a_turn_longer_than_the_window_rewinds_its_end_or_restarts_where_it_began(
    narrow: Loaded,
) -> None:
    # Each turn is longer than the window: the sliding layers hold their window at the
    # turn's start (the checkpoint) and at its end, plus the margin before the latter.
    # A rewrite within the margin costs what differs; a deeper one restarts at the
    # checkpoint.
    def rewrite(turn: int, n: int, rng: random.Random) -> int:
        return rng.randint(1, SLIDING_MARGIN) if turn % 2 else rng.randint(min(100, n), n)

    turns = rewritten_turns(narrow, 10, new=80, reply=30, rewrite=rewrite)
    restarts = 0
    for number, (admission, prompt, reply, keep) in enumerate(turns[1:], 1):
        last_start = turns[number - 1][3]  # where the last turn's new tokens began
        assert admission.reusable_tokens == keep
        _, last_prompt, last_reply, _ = turns[number - 1]
        if len(last_prompt) + len(last_reply) - keep <= SLIDING_MARGIN:
            assert admission.cached_tokens == keep, number
        assert admission.cached_tokens in (keep, last_start), number
        if admission.cached_tokens < keep:
            restarts += 1
            assert admission.not_reused is not None
            assert f"changed at token {keep}" in admission.not_reused
        assert reply == reference(narrow.model, prompt, 30, stop=EOS), number
    assert restarts > 0


@pytest.mark.parametrize("join_after", [0, 5])
def test_in_the_batch_too_a_rewrite_of_the_last_tokens_costs_only_what_differs(
    narrow: Loaded, join_after: int
) -> None:
    # Three agents decode together, replies longer than the window; the first decodes
    # alone for `join_after` steps before the others join it (its cache moves into
    # the batch). Each next turn rewrites up to SLIDING_MARGIN of the last tokens.
    pool = BlockPool(narrow.spec, total_blocks=300)
    engine = BlockPoolBatchEngine(narrow.model, narrow.tokenizer, pool)
    rng = random.Random(5)
    held: dict[str, Any] = {}
    keeps = dict.fromkeys("abc", 0)  # where each one's last turn began
    for turn in range(5):
        uids, prompts, done = {}, {}, {}
        for number, name in enumerate("abc"):
            fresh = [rng.randrange(256) for _ in range(20)]
            blocks = held.get(name)
            if blocks is None:
                prompt, keep = [number, *fresh], 0
            else:
                # within the last turn, and at most SLIDING_MARGIN tokens back
                depth = rng.randint(1, min(SLIDING_MARGIN, blocks.num_tokens - keeps[name]))
                keep = blocks.num_tokens - depth
                prompt = [*blocks.tokens[:keep], *fresh]
                while prompt[keep] == blocks.tokens[keep]:
                    prompt[keep] = (prompt[keep] + 1) % 256
            trim = blocks.num_tokens - keep if blocks is not None else 0
            uids[name] = engine.submit(name, prompt[keep:], blocks, trim=trim, max_tokens=50)
            prompts[name], keeps[name] = prompt, keep
            admission = engine.admission(uids[name])
            assert admission is not None and admission.cached_tokens == keep, (turn, name)
            if number == 0:
                for _ in range(join_after):
                    done.update((r.uid, r) for r in engine.step())
        done.update(run_to_completion(engine))
        assert engine.statistics().max_decode_batch >= 2
        for name, uid in uids.items():
            result = done[uid]
            want = reference(narrow.model, prompts[name], 50, stop=EOS)
            assert list(result.tokens) == want, (turn, name)
            engine.release(held.get(name))
            held[name] = result.blocks
    for blocks in held.values():
        engine.release(blocks)
    assert pool.used_blocks == 0
    engine.close()


def test_a_rewrite_before_the_checkpoint_starts_further_back(narrow: Loaded) -> None:
    # Rewrites that reach 80 tokens into the turn before the last: the sliding layers
    # hold no state there (only what their blocks happen to keep around the window),
    # so the history is prefilled again from further back, and still exactly.
    turns = rewritten_turns(
        narrow, 6, new=40, reply=30, rewrite=lambda t, n, rng: n + 80, first=400
    )
    for number, (admission, prompt, reply, keep) in enumerate(turns[1:], 1):
        assert admission.reusable_tokens == keep
        assert admission.cached_tokens <= keep
        assert (admission.not_reused is None) == (admission.cached_tokens == keep)
        assert reply == reference(narrow.model, prompt, 30, stop=EOS), number
    assert any(a.cached_tokens == 0 < a.reusable_tokens for a, *_ in turns)


def first_turn(model: Loaded, engine: BlockPoolBatchEngine, length: int) -> Any:
    """One agent's first turn: ``length`` prompt tokens and a short reply; its result."""
    prompt = [(7 * i + 3) % 256 for i in range(length)]
    uid = engine.submit("a", prompt, None, max_tokens=6)
    return run_to_completion(engine)[uid]


def test_a_cancelled_prefill_that_keeps_a_checkpoint_returns_its_blocks(
    narrow: Loaded,
) -> None:
    # The next turn changes the history at token 2500, long before the window at its
    # end: the prefill from token 0 runs as a job that stops at 2500 to keep the
    # checkpoint, longer than one step's chunks. Cancelled half-way, the job goes too.
    pool = BlockPool(narrow.spec, total_blocks=200)
    engine = BlockPoolBatchEngine(narrow.model, narrow.tokenizer, pool, prefill_batch_size=1)
    blocks = first_turn(narrow, engine, 2600).blocks
    engine.pacing.ceiling = 1024  # a fast machine would run the whole job in one step
    prompt = [*blocks.tokens[:2500], 1, 2, 3]
    uid = engine.submit("a", prompt[2500:], blocks, trim=blocks.num_tokens - 2500, max_tokens=4)
    assert engine.admission(uid).cached_tokens == 0  # type: ignore[union-attr]
    assert pool.statistics().reserved_blocks > 0
    jobs = engine.statistics().prefill_jobs
    engine.step()
    assert engine.statistics().prefill_jobs == jobs + 1  # running, not yet at 2500
    assert engine.statistics().checkpoints == 0
    assert engine.cancel(uid)
    assert pool.statistics().reserved_blocks == 0
    assert pool.used_blocks == blocks.num_blocks
    assert engine.step() == [] and engine.last_step is None  # nothing left to run
    engine.release(blocks)
    assert pool.used_blocks == 0
    engine.close()


def test_a_turn_whose_prefill_another_shares_still_keeps_its_checkpoint(narrow: Loaded) -> None:
    # A forked agent and its parent send the same deep rewrite together: the parent's
    # prefill becomes a job the fork waits on, and both turns still keep the state
    # where they began (token 300), so their next rewrites start there.
    pool = BlockPool(narrow.spec, total_blocks=300)
    engine = BlockPoolBatchEngine(narrow.model, narrow.tokenizer, pool)
    blocks = first_turn(narrow, engine, 600).blocks
    fork = engine.share(blocks)
    prompt = [*blocks.tokens[:300], *[(11 * i) % 256 for i in range(300)]]
    trim = blocks.num_tokens - 300
    jobs = engine.statistics().prefill_jobs
    uids = [
        engine.submit(name, prompt[300:], b, trim=trim, max_tokens=8)
        for name, b in (("a", blocks), ("b", fork))
    ]
    done = run_to_completion(engine)
    assert engine.statistics().prefill_jobs == jobs + 1  # the fork waited for the parent's
    engine.release(blocks)
    engine.release(fork)
    seconds = [done[uid] for uid in uids]
    assert list(seconds[0].tokens) == reference(narrow.model, prompt, 8, stop=EOS)
    assert seconds[1].tokens == seconds[0].tokens
    # each one's next turn changes the history inside the last one, before the blocks
    # that hold its window (from token 512)
    for name, second in zip("ab", seconds, strict=True):
        prompt = [*second.blocks.tokens[:330], *[(13 * i) % 256 for i in range(20)]]
        trim = second.blocks.num_tokens - 330
        uid = engine.submit(name, prompt[330:], second.blocks, trim=trim, max_tokens=8)
        admission = engine.admission(uid)
        assert admission is not None and admission.reusable_tokens == 330
        assert admission.cached_tokens == 300, name  # the checkpoint, not token 0
        third = run_to_completion(engine)[uid]
        assert list(third.tokens) == reference(narrow.model, prompt, 8, stop=EOS)
        engine.release(second.blocks)
        engine.release(third.blocks)
    assert pool.used_blocks == 0
    engine.close()


@pytest.mark.parametrize("cancelled", [0, 1])
def test_cancelling_either_side_of_a_prefill_that_keeps_checkpoints(
    narrow: Loaded, cancelled: int
) -> None:
    # As above, one of the two is cancelled while the parent's job runs: the other
    # finishes exactly, with its checkpoint, and every block comes back.
    pool = BlockPool(narrow.spec, total_blocks=300)
    engine = BlockPoolBatchEngine(narrow.model, narrow.tokenizer, pool, prefill_batch_size=1)
    blocks = first_turn(narrow, engine, 2800).blocks
    fork = engine.share(blocks)
    prompt = [*blocks.tokens[:2700], *[(11 * i) % 256 for i in range(300)]]
    trim = blocks.num_tokens - 2700
    uids = [
        engine.submit(name, prompt[2700:], b, trim=trim, max_tokens=8)
        for name, b in (("a", blocks), ("b", fork))
    ]
    engine.step()  # the job stops short of 2700 (chunks of 2048 at most, on any machine)
    assert engine.statistics().checkpoints == 0
    assert engine.cancel(uids[cancelled])
    done = run_to_completion(engine)
    assert list(done) == [uids[1 - cancelled]]
    result = done[uids[1 - cancelled]]
    assert list(result.tokens) == reference(narrow.model, prompt, 8, stop=EOS)
    engine.release(blocks)
    engine.release(fork)
    assert pool.used_blocks == result.blocks.num_blocks
    assert pool.statistics().reserved_blocks == 0
    prompt = [*result.blocks.tokens[:2730], 5, 6, 7]
    uid = engine.submit(
        "c", prompt[2730:], result.blocks, trim=result.blocks.num_tokens - 2730, max_tokens=4
    )
    admission = engine.admission(uid)
    assert admission is not None and admission.cached_tokens == 2700  # its checkpoint
    engine.cancel(uid)
    engine.release(result.blocks)
    assert pool.used_blocks == 0 and pool.statistics().reserved_blocks == 0
    engine.close()


def test_sliding_layers_hold_the_window_and_the_checkpoint(wide: Loaded) -> None:
    pool = BlockPool(wide.spec, total_blocks=200)
    engine = BlockPoolBatchEngine(wide.model, wide.tokenizer, pool)
    blocks, total = None, 0
    for turn in range(8):
        uid = engine.submit("a", [(5 * i + turn) % 256 for i in range(40)], blocks, max_tokens=8)
        result = run_to_completion(engine)[uid]
        engine.release(blocks)
        start, blocks = total, result.blocks
        total = blocks.num_tokens
        for layer, held in zip(wide.spec.layers, blocks.layers):
            if layer.kind is LayerKind.SLIDING:
                first = min(b.start for b in held)
                assert first <= max(0, start - 96)  # the window before the turn began
                assert first > start - 96 - 256  # and nothing older than its block
    assert total > 256 + 96
    engine.release(blocks)
    engine.close()


def stops_seen(model: Loaded, system: str, text: str, words: int) -> tuple[str, ...]:
    """Two characters of the model's own first reply to ``text``, as stop strings: so
    that, whatever the random weights write, some replies end on one."""
    prompt = render(
        model.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": text}]
    )
    reply = model.tokenizer.decode(reference(model.model, prompt, words))
    seen = [c for c in reply[2:] if c.isascii() and c.isprintable() and not c.isspace()]
    return tuple(dict.fromkeys(seen))[:2] or ("e", "o")


@pytest.mark.anyio
# turns shorter than the window, then longer; each on one of the event loops
@pytest.mark.parametrize(("window", "anyio_backend"), [(160, "asyncio"), (16, "trio")])
# "paged": concurrent turns whose batch reads the histories from the blocks
@pytest.mark.parametrize("case", ["stop", "trim", "concurrent", "paged"])
async def test_dialogues_reuse_every_matching_token_and_equal_mlx_lm(
    case: str, window: int, anyio_backend: str, tmp_path: Path
) -> None:
    template = TRIM_TEMPLATE if case == "trim" else None
    model = gemma(tmp_path / case, window=window, template=template)
    paged = case == "paged"
    case = "concurrent" if paged else case
    rounds, words = 10, 24
    first = "Round 0: where now?" if case == "concurrent" else "0. Where shall we go?"
    stop = stops_seen(model, "You are agent 0.", first, words) if case != "trim" else None
    async with Runtime(model.path, pool_blocks=400, log_level="off", paged_batch=paged) as rt:
        agents = [
            await rt.spawn(f"a{i}", system=f"You are agent {i}.", max_tokens=words, stop=stop)
            for i in range(2)
        ]
        replies: dict[str, list[Any]] = {a.name: [] for a in agents}

        async def ask(agent: Any, text: str) -> None:
            replies[agent.name].append(await agent.ask(text))

        line = "Where shall we go?"
        for r in range(rounds):
            if case == "concurrent":
                async with anyio.create_task_group() as tg:
                    for agent in agents:
                        tg.start_soon(ask, agent, f"Round {r}: where now?")
            else:
                for agent in agents:
                    await ask(agent, f"{r}. {line}")
                    line = replies[agent.name][-1].text[:8] or "Go on."
        histories = {a.name: a.history for a in agents}
    eos = model.tokenizer.eos_token_ids
    rewritten = stopped = 0
    for name, history in histories.items():
        cached = 0
        for turn, reply in enumerate(replies[name]):
            usage = reply.usage
            assert usage.cached_tokens >= usage.reusable_tokens, (name, turn)  # none lost
            rewritten += 0 < usage.reusable_tokens < cached
            cached = usage.cached_tokens + usage.prompt_tokens + usage.generated_tokens
            # mlx-lm re-rendering the same conversation, from scratch
            prompt = render(model.tokenizer, history[: 2 + 2 * turn])
            want, got = reference(model.model, prompt, words, stop=eos), list(reply.tokens)
            assert got == want[: len(got)], (name, turn)
            if len(got) < len(want):  # a stop string ended it
                text = model.tokenizer.decode(got)
                assert stop is not None and any(s in text for s in stop), (name, turn)
                stopped += 1
        assert cached > 256 + 160  # the history crossed blocks and windows
    assert rewritten > 0  # the cache was rewritten near its end: the rewind ran
    assert stop is None or stopped > 0


@pytest.mark.anyio
async def test_the_trace_says_when_and_why_history_was_not_reused(
    anyio_backend: str, tmp_path: Path
) -> None:
    # A template that counts the messages at the top changes every history near its
    # start: once the history outgrew the window and the margin, the sliding layers
    # hold nothing there, and the trace says so.
    template = "Messages: {{ messages | length }}.\n" + CHATML_TEMPLATE
    model = gemma(tmp_path / "model", window=24, template=template)
    path = tmp_path / "run.jsonl"
    async with Runtime(model.path, pool_blocks=200, trace=path, log_level="off") as rt:
        agent = await rt.spawn("ann", max_tokens=24)
        for r in range(6):
            await agent.ask(f"Turn {r}: say something long enough to fill the window.")
    admitted = [
        e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "turn.admitted"
    ]
    assert len(admitted) == 6
    for event in admitted:
        lost = event["cached_tokens"] < event["reusable_tokens"]
        assert ("not_reused" in event) == lost
        if lost:
            assert "sliding-window" in event["not_reused"]
            assert f"changed at token {event['reusable_tokens']}" in event["not_reused"]
    assert any("not_reused" in e for e in admitted)


@pytest.mark.anyio
@pytest.mark.parametrize(("pool_blocks", "anyio_backend"), [(400, "asyncio"), (8, "trio")])
async def test_the_checkpoint_survives_eviction_and_restart(
    pool_blocks: int, anyio_backend: str, tmp_path: Path
) -> None:
    # With 8 blocks, the pool holds one agent's cache at a time: every turn restores
    # the other's from host memory or disk; a restart reads them from the state files.
    model = gemma(tmp_path / "model", window=160)
    state = tmp_path / "state"
    replies: dict[str, list[Any]] = {"a": [], "b": []}
    histories: dict[str, list[Any]] = {}
    blocks: dict[str, int] = {}
    for run in range(2):
        async with Runtime(
            model.path, pool_blocks=pool_blocks, log_level="off", state_dir=state
        ) as rt:
            agents = (
                [await rt.spawn(n, system=f"You are {n}.", max_tokens=24) for n in replies]
                if run == 0
                else [rt.agent(n) for n in replies]
            )
            if run == 1:  # a resumed agent counts the blocks its saved cache holds
                assert {a.name: a.statistics().cached_blocks for a in agents} == blocks
            for r in range(5):
                for agent in agents:
                    replies[agent.name].append(await agent.ask(f"Run {run}, turn {r}: go on."))
            histories = {a.name: a.history for a in agents}
            blocks = {a.name: a.statistics().cached_blocks for a in agents}
            if pool_blocks < 100:
                assert (await rt.stats()).restores > 0
    for name, history in histories.items():
        for turn, reply in enumerate(replies[name]):
            assert reply.usage.cached_tokens >= reply.usage.reusable_tokens, (name, turn)
            prompt = render(model.tokenizer, history[: 2 + 2 * turn])
            assert list(reply.tokens) == reference(model.model, prompt, 24, stop=EOS)
        assert sum(r.usage.generated_tokens + r.usage.prompt_tokens for r in replies[name]) > 416
