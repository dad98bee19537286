"""A sequence decoding alone runs outside the ``BatchGenerator`` (``Solo``), as mlx-lm's
``generate_step`` runs it, and moves into the batch, with its cache, when another joins:
greedy output stays token-identical to mlx-lm either way."""

from __future__ import annotations

import pytest

from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine

from ..conftest import Loaded, ReferenceChat, reference, run_to_completion
from .test_engine import prompt

N = 30


def steps(engine: BlockPoolBatchEngine, n: int) -> list[object]:
    done = []
    for _ in range(n):
        done.extend(engine.step())
    return done


def until_emitted(engine: BlockPoolBatchEngine, n: int) -> list[object]:
    """Step until the lone sequence has emitted ``n`` tokens (its prompt may take a few
    paced steps first)."""
    done = []
    while engine.statistics().solo_tokens < n:
        done.extend(engine.step())
    return done


def test_a_lone_sequence_decodes_alone_and_matches_mlx_lm(
    tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    chat = ReferenceChat(tiny.model, eos)
    history: list[int] = []
    blocks = None
    for turn, (n_new, n_out) in enumerate([(300, N), (40, N), (1, 5)]):
        new = prompt(n_new, 40 + turn)
        expected = chat.turn([*history, *new], n_out)
        uid = engine.submit("a", new, blocks, max_tokens=n_out)
        result = run_to_completion(engine)[uid]
        assert list(result.tokens) == expected, f"turn {turn}"
        engine.release(blocks)
        blocks = result.blocks
        history = [*history, *new, *expected]
        assert blocks.tokens == tuple(history)
    stats = engine.statistics()
    assert stats.solo_tokens == stats.generated_tokens > 0
    assert stats.max_decode_batch == 1
    # the first token comes out of the step that prefills the prompt
    uid = engine.submit("a", prompt(20, 9), blocks, max_tokens=3)
    assert engine.step() == [] and engine.last_step is not None
    assert engine.last_step.prefill_tokens == 20 and engine.last_step.decode_batch == 1
    run_to_completion(engine)
    engine.release(blocks)


@pytest.mark.parametrize("join_after", [0, 1, 7])
def test_a_second_sequence_joins_a_lone_one_mid_decode(
    tiny: Loaded, engine: BlockPoolBatchEngine, join_after: int
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    first, second = prompt(90, 1), prompt(50, 2)
    expected = [reference(tiny.model, p, N, stop=eos) for p in (first, second)]
    a = engine.submit("a", first, max_tokens=N)
    done = {r.uid: r for r in until_emitted(engine, join_after)}  # type: ignore[attr-defined]
    b = engine.submit("b", second, max_tokens=N)
    done.update(run_to_completion(engine))
    assert [list(done[a].tokens), list(done[b].tokens)] == expected
    assert done[a].blocks.tokens == (*first, *expected[0])
    stats = engine.statistics()
    # alone it emitted a token per step, and one more as it joined the batch
    assert stats.solo_tokens == (join_after + 1 if join_after else 0)
    assert stats.max_decode_batch == 2
    # the token it joined with was generated, not prefilled
    assert stats.prefill_tokens == len(first) + len(second)
    # the cache the batch finished with continues exactly
    nxt = prompt(10, 3)
    uid = engine.submit("a", nxt, done[a].blocks, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == reference(tiny.model, [*first, *expected[0], *nxt], N, stop=eos)
    for r in (done[a], done[b], result):
        engine.release(r.blocks)
    assert engine.pool.used_blocks == 0


@pytest.mark.parametrize("how", ["length", "stop-string"])
def test_a_sequence_handed_over_on_its_last_token_finishes_with_its_whole_cache(
    tiny: Loaded, engine: BlockPoolBatchEngine, how: str
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    first = prompt(70, 5)
    full = reference(tiny.model, first, N, stop=eos)
    # the streamed text of each token: the stop string is the first piece of text that
    # did not come before (random weights emit random bytes)
    pieces: list[str] = []
    uid = engine.submit("a", first, max_tokens=N, on_token=lambda e: pieces.append(e.text))
    engine.release(run_to_completion(engine)[uid].blocks)
    cut = next(
        i + 1 for i in range(3, N) if pieces[i] and pieces[i] not in "".join(pieces[:i])
    )  # the hand-over emits token number `cut`
    if how == "length":
        a = engine.submit("a", first, max_tokens=cut)
    else:
        a = engine.submit("a", first, max_tokens=N, stop=[pieces[cut - 1]])
    solo = engine.statistics().solo_tokens
    assert until_emitted(engine, solo + cut - 1) == []
    engine.submit("b", prompt(30, 6), max_tokens=4)
    done = steps(engine, 1)
    ((result,),) = [[r for r in done if r.uid == a]]  # type: ignore[attr-defined]
    assert list(result.tokens) == full[:cut]
    assert result.finish_reason == ("length" if how == "length" else "stop")
    assert result.blocks.tokens == (*first, *full[:cut])
    # its blocks hold the last token: the next turn continues exactly
    nxt = prompt(12, 7)
    uid = engine.submit("a", nxt, result.blocks, max_tokens=N)
    rest = run_to_completion(engine)
    assert list(rest[uid].tokens) == reference(tiny.model, [*first, *full[:cut], *nxt], N, stop=eos)
    for r in (result, *rest.values()):
        engine.release(r.blocks)
    assert engine.pool.used_blocks == 0


def test_cancelling_a_lone_sequence(engine: BlockPoolBatchEngine, tiny: Loaded) -> None:
    a = engine.submit("a", prompt(40, 8), max_tokens=N)
    steps(engine, 3)
    assert engine.cancel(a)
    assert engine.active == 0 and engine.pool.statistics().reserved_blocks == 0
    assert engine.pool.used_blocks == 0
    # the engine goes on: a new lone sequence decodes exactly
    p = prompt(25, 9)
    uid = engine.submit("b", p, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == reference(tiny.model, p, N, stop=tiny.tokenizer.eos_token_ids)
    engine.release(result.blocks)


def test_an_agents_next_lone_turn_starts_from_its_kept_cache(
    tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    eos = tiny.tokenizer.eos_token_ids
    chat = ReferenceChat(tiny.model, eos)
    first = prompt(600, 11)
    expected = chat.turn(first, N)
    uid = engine.submit("a", first, max_tokens=N)
    blocks = run_to_completion(engine)[uid].blocks
    history = [*first, *expected]
    # the same agent again: from its kept cache, exactly
    nxt = prompt(30, 12)
    expected = chat.turn([*history, *nxt], N)
    uid = engine.submit("a", nxt, blocks, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == expected
    assert engine.statistics().hot_starts == 1
    engine.release(blocks)
    blocks, history = result.blocks, [*history, *nxt, *expected]
    # a rewritten history: the kept cache is cut back to where it agrees
    rewritten = [*history[:-40], *prompt(25, 13)]
    common = blocks.common_prefix(rewritten)
    uid = engine.submit(
        "a", rewritten[common:], blocks, trim=blocks.num_tokens - common, max_tokens=N
    )
    result = run_to_completion(engine)[uid]
    assert list(result.tokens) == reference(tiny.model, rewritten, N, stop=eos)
    assert engine.statistics().hot_starts == 2
    # another agent's turn in between: its own cache is kept, the first one's still
    # serves, and a turn that does not continue a kept cache gathers its blocks
    other = engine.submit("b", prompt(40, 14), max_tokens=5)
    engine.release(run_to_completion(engine)[other].blocks)
    engine.release(blocks)
    blocks = result.blocks
    again = prompt(9, 15)
    uid = engine.submit("a", again, blocks, max_tokens=N)
    last = run_to_completion(engine)[uid]
    assert list(last.tokens) == reference(
        tiny.model, [*rewritten, *result.tokens, *again], N, stop=eos
    )
    assert engine.statistics().hot_starts == 3
    engine.release(blocks)
    engine.release(last.blocks)
    assert engine.pool.used_blocks == 0


def test_a_forgotten_agents_kept_cache_is_dropped(
    tiny: Loaded, engine: BlockPoolBatchEngine
) -> None:
    first = prompt(300, 21)
    uid = engine.submit("a", first, max_tokens=5)
    blocks = run_to_completion(engine)[uid].blocks
    engine.forget("a")
    nxt = prompt(20, 22)
    uid = engine.submit("a", nxt, blocks, max_tokens=N)
    result = run_to_completion(engine)[uid]
    assert engine.statistics().hot_starts == 0  # gathered from its blocks instead
    assert list(result.tokens) == reference(
        tiny.model, [*blocks.tokens, *nxt], N, stop=tiny.tokenizer.eos_token_ids
    )
    engine.release(blocks)
    engine.release(result.blocks)


def test_kept_caches_count_in_the_pools_budget_and_make_way_first(tiny: Loaded) -> None:
    """A kept cache holds the pool units its bytes cost, given back when its agent's next
    turn takes it; when a turn needs room, kept caches give theirs back before anything
    else (here the engine has no other way to make room: the turn would be refused)."""

    def engine_of(total: int) -> BlockPoolBatchEngine:
        return BlockPoolBatchEngine(
            tiny.model, tiny.tokenizer, BlockPool(tiny.spec, total_blocks=total), max_batch_size=8
        )

    probe = engine_of(400)
    uid = probe.submit("a", prompt(600, 31), max_tokens=N)
    blocks = run_to_completion(probe)[uid].blocks
    used, copies = probe.pool.used_blocks, probe.pool.copy_blocks
    assert copies > 0 and probe.pool.free_blocks == 400 - used - copies
    uid = probe.submit("a", prompt(20, 32), blocks, max_tokens=N)  # takes it: given back
    probe.release(blocks)
    result = run_to_completion(probe)[uid]
    assert probe.statistics().hot_starts == 1
    probe.release(result.blocks)
    probe.close()
    # Room for two agents' blocks and half a kept cache: the second agent's turn fits
    # only once the first one's kept cache has made way.
    engine = engine_of(2 * used + copies // 2)
    uid = engine.submit("a", prompt(600, 31), max_tokens=N)
    a = run_to_completion(engine)[uid].blocks
    assert engine.pool.copy_blocks == copies
    nxt = prompt(600, 33)
    uid = engine.submit("b", nxt, max_tokens=N)
    b = run_to_completion(engine)[uid]
    assert list(b.tokens) == reference(tiny.model, nxt, N, stop=tiny.tokenizer.eos_token_ids)
    stats = engine.pool.statistics()
    assert stats.peak_blocks <= stats.total_blocks
    uid = engine.submit("a", prompt(20, 34), a, max_tokens=4)
    engine.release(a)
    engine.release(run_to_completion(engine)[uid].blocks)
    assert engine.statistics().hot_starts == 0  # a's kept cache was gone
    engine.release(b.blocks)
    engine.close()
