"""What multi-agent scripts need besides ask: telling an agent something without a turn,
seeding a conversation, and asking several agents at once (``gather``), on both
backends; each reply compared with mlx-lm's own on the rendered conversation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import anyio
import pytest

from mlx_actors import Message, Runtime, gather
from mlx_actors.errors import (
    InvalidRequestError,
    ModelIntegrityError,
    ModelNotFoundError,
    RuntimeClosedError,
)
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import Loaded, reference, render

#: ChatML that refuses two messages of one role in a row, as Gemma's template does.
ALTERNATING = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def expected(model: Loaded, agent: object, max_tokens: int) -> list[int]:
    """mlx-lm's greedy reply to the agent's conversation before its last reply."""
    history = list(agent.history)[:-1]  # type: ignore[attr-defined]
    return reference(model.model, render(model.tokenizer, history), max_tokens, stop=[258])


@pytest.mark.anyio
async def test_tell_adds_a_message_that_the_next_turn_reads(tiny: Loaded, tmp_path: Path) -> None:
    async with Runtime(tiny.path, pool_blocks=200, log_level="off", state_dir=tmp_path) as rt:
        bob = await rt.spawn("bob", system="You listen.", max_tokens=12)
        await bob.ask("Hello.")
        cached = bob.cached_tokens
        await bob.tell("Ann said: we should build it.")
        await bob.tell("I agree with Ann.", role="assistant")
        assert bob.cached_tokens == cached  # nothing ran through the model
        assert [m.role for m in bob.history] == [
            "system",
            *("user", "assistant", "user", "assistant"),
        ]
        reply = await bob.ask("What do you think?")
        assert list(reply.tokens) == expected(tiny, bob, 12)
        assert reply.usage.cached_tokens > 0  # the told messages alone were new
        with pytest.raises(InvalidRequestError):
            await bob.tell("x", role="system")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            await bob.tell("   ")
        history = bob.history
    async with Runtime(tiny.path, pool_blocks=200, log_level="off", state_dir=tmp_path) as rt:
        assert rt.agent("bob").history == history  # told messages are kept


@pytest.mark.anyio
async def test_a_template_that_refuses_the_conversation_is_a_typed_error(
    tmp_path: Path,
) -> None:
    path = write_random_model(
        tmp_path / "alternating", tiny_config(), seed=3, chat_template=ALTERNATING
    )
    async with Runtime(path, pool_blocks=200, log_level="off") as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        await ann.tell("First.")
        with pytest.raises(InvalidRequestError, match="roles must alternate"):
            await ann.ask("Second.")
        assert [m.content for m in ann.history] == ["First."]
        assert (await rt.stats()).pool.used_blocks == 0


@pytest.mark.anyio
async def test_spawn_seeds_the_conversation(tiny: Loaded) -> None:
    async with Runtime(tiny.path, pool_blocks=200, log_level="off") as rt:
        seeded = await rt.spawn(
            "s",
            history=[
                Message(role="user", content="Say yes."),
                {"role": "assistant", "content": "Yes."},
            ],
            max_tokens=12,
        )
        reply = await seeded.ask("Again?")
        assert [m.content for m in seeded.history[:3]] == ["Say yes.", "Yes.", "Again?"]
        assert list(reply.tokens) == expected(tiny, seeded, 12)
        for bad in ([{"role": "system", "content": "x"}], ["text"], [{"role": "user"}]):
            with pytest.raises(InvalidRequestError):
                await rt.spawn("bad", history=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="non-empty"):
            await rt.spawn("bad", history=[{"role": "user", "content": " \n"}])
        # a model may reply with only whitespace (or nothing): its history is taken back
        quiet = await rt.spawn(
            "quiet",
            history=[
                {"role": "user", "content": "Say nothing."},
                {"role": "assistant", "content": " \n"},
            ],
            max_tokens=12,
        )
        again = await rt.spawn("again", history=quiet.history, max_tokens=12)
        assert again.history == quiet.history
        reply = await again.ask("Again?")
        assert list(reply.tokens) == expected(tiny, again, 12)


@pytest.mark.anyio
async def test_gather_asks_at_once_and_keeps_the_order(tiny: Loaded) -> None:
    questions = ["One?", "Two, please?", "Three!"]
    async with Runtime(tiny.path, pool_blocks=200, log_level="off") as rt:
        panel = [await rt.spawn(f"p{i}", max_tokens=10) for i in range(3)]
        replies = await gather(*(p.ask(q) for p, q in zip(panel, questions)))
        assert (await rt.stats()).max_batch_size >= 2  # they ran together
        for agent, reply in zip(panel, replies):
            assert agent.history[-1].content == reply.text
            assert list(reply.tokens) == expected(tiny, agent, 10)


@pytest.mark.anyio
async def test_gather_cancels_the_rest_when_one_fails(tiny: Loaded) -> None:
    async with Runtime(tiny.path, pool_blocks=200, log_level="off") as rt:
        slow = await rt.spawn("slow", max_tokens=4000)
        quick = await rt.spawn("quick")
        with anyio.fail_after(60), pytest.raises(InvalidRequestError, match="max_tokens"):
            await gather(slow.ask("Talk for long."), quick.ask("x", max_tokens=0))
        assert slow.history == () and slow.cached_tokens == 0  # cancelled, undone
        assert (await rt.stats()).pool.used_blocks == 0


# -- a newcomer's mistakes get errors that say what to do ------------------------------------


def test_a_runtime_entered_without_async_says_how(tiny: Loaded) -> None:
    with pytest.raises(InvalidRequestError, match="async with Runtime"):
        with Runtime(tiny.path):  # type: ignore[attr-defined]
            pass


def test_a_model_path_that_names_nothing_is_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no model at"):
        Runtime(tmp_path / "nothing-here")


@pytest.mark.anyio
async def test_start_up_errors_come_without_the_engine_threads_frames(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelIntegrityError) as info:
        async with Runtime(broken, log_level="off"):
            pass
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_thread_main" not in frames and "wait_started" in frames
    assert info.value.__suppress_context__  # the cause is kept, not printed


@pytest.mark.anyio
async def test_asking_after_the_runtime_ended_says_so(tiny: Loaded) -> None:
    async with Runtime(tiny.path, pool_blocks=100, log_level="off") as rt:
        agent = await rt.spawn("late", max_tokens=4)
    with pytest.raises(RuntimeClosedError, match="runtime has shut down"):
        await agent.ask("Still there?")


def test_a_text_past_the_tokenizers_own_maximum_prints_no_warning(tmp_path: Path) -> None:
    """The runtime checks lengths against the model's context itself; transformers'
    "Token indices sequence length is longer than..." reached stderr before its error.
    (In a process of its own: transformers' handler writes to the stderr it found at
    import.)"""
    path = write_random_model(tmp_path / "short", tiny_config(), seed=3)
    config = path / "tokenizer_config.json"
    short = config.read_text().replace(f'"model_max_length": {1 << 20}', '"model_max_length": 32')
    config.write_text(short)
    script = textwrap.dedent(
        """
        import sys
        import anyio
        from mlx_actors import Runtime

        async def main() -> None:
            async with Runtime(sys.argv[1], pool_blocks=50, log_level="off") as rt:
                agent = await rt.spawn("a", max_tokens=2)
                print((await agent.ask("word " * 20)).usage.prompt_tokens)

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and int(done.stdout) > 32
    assert done.stderr == ""
