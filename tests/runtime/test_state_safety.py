"""The state directory under damage and misuse: links are never followed, corrupt or
odd records and indexes are typed errors that cost only their agent, records carry
checksums, and a full disk or an unwritable directory fails typed, losing nothing a
caller was given."""

from __future__ import annotations

import base64
import errno
import json
import random
from pathlib import Path

import anyio
import numpy as np
import pytest

from mlx_actors import Runtime
from mlx_actors.errors import CorruptStateError, StateWriteError
from mlx_actors.runtime import _disk, _store

from ..conftest import Loaded, ReferenceChat, render
from .test_persistence import converse, question, snapshot

pytestmark = pytest.mark.anyio


class Disk:
    """``write_atomic`` that fails with ENOSPC while ``full`` (for some paths)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.only: str | None = None  # only paths containing this fail
        write = _disk.write_atomic

        def write_atomic(path: Path, data: bytes) -> None:
            if self.full and (self.only is None or self.only in str(path)):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write(path, data)

        monkeypatch.setattr(_disk, "write_atomic", write_atomic)


async def test_a_full_disk_fails_the_turn_and_loses_no_returned_reply(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    disk = Disk(monkeypatch)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=8)
        first = await ann.ask("One")
        disk.full = True
        with pytest.raises(StateWriteError, match="No space left") as info:
            await ann.ask("Two")
        assert isinstance(info.value, OSError)
        assert [m.content for m in ann.history] == ["One", first.text]  # as before the turn
        with pytest.raises(StateWriteError):
            await rt.spawn("bob")
        assert "bob" not in rt.agents  # never made: the name is free again
        disk.full = False
        bob = await rt.spawn("bob", max_tokens=8)
        second = await ann.ask("Two")
        disk.full, disk.only = True, "caches"  # the cache cannot be written, the record can
        third = await ann.ask("Three")  # the turn is kept: the cache is only an aid
        await bob.ask("Hi")
        disk.full = False
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = rt.agent("ann")
        assert [m.content for m in ann.history] == [
            "One", first.text, "Two", second.text, "Three", third.text,
        ]  # fmt: skip
        assert "bob" in rt.agents
        reply = await ann.ask("Four")  # the older cache on disk still serves its prefix
        assert reply.usage.cached_tokens > 0


async def test_opening_a_state_directory_that_cannot_be_written_is_a_typed_error(
    tiny_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateWriteError):
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=blocker / "s"):
            pass


async def test_links_in_the_state_directory_are_never_followed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state, outside = tmp_path / "state", tmp_path / "outside"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(1))
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "secret.json").write_text(json.dumps({"format": 2}))
    before = snapshot(outside)
    # ann's cache directory is now a link to a directory outside
    for path in (state / "caches" / "ann").iterdir():
        path.unlink()
    (state / "caches" / "ann").rmdir()
    (state / "caches" / "ann").symlink_to(outside)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        for _ in range(2):  # saves, and their clean-ups
            await rt.agent("ann").ask("Again?")
        await rt.agent("ann").reset()
        await rt.agent("ann").close()
    assert snapshot(outside) == before
    # links in place of the state directory's own folders, or of a record: refused
    for link, target in [
        (state / "caches" / "_blocks", outside),
        (state / "agents" / "eve.json", outside / "secret.json"),
    ]:
        saved = state / "saved"
        if link.exists():
            link.rename(saved)
        link.symlink_to(target)
        with pytest.raises(CorruptStateError, match="symbolic link"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass
        link.unlink()
        if saved.exists():
            saved.rename(link)
        assert snapshot(outside) == before


async def test_folders_replaced_by_links_while_running_are_not_followed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``agents/`` and ``caches/_blocks/`` swapped for links to folders outside while the
    runtime runs: before, records and chunks were written there, and an outside file
    named like a chunk was deleted. Now each write or delete checks its folder first:
    the save fails (typed), and nothing outside changes."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        ann = await rt.spawn("ann", max_tokens=4)
        await ann.ask("Hello")
        for folder in ("agents", "blocks"):
            (outside / folder).mkdir(parents=True)
        for chunk in (state / "caches" / "_blocks").iterdir():  # a victim of the same name
            (outside / "blocks" / chunk.name).write_text("keep me")
        before = snapshot(outside)
        for link, target in [
            (state / "agents", outside / "agents"),
            (state / "caches" / "_blocks", outside / "blocks"),
        ]:
            link.rename(link.with_name(link.name + ".real"))
            link.symlink_to(target)
        with pytest.raises(CorruptStateError, match="replaced"):
            await ann.ask("Again?")
        assert [m.content for m in ann.history][:1] == ["Hello"] and len(ann.history) == 2
        await ann.close()
        assert snapshot(outside) == before


async def test_an_index_that_names_a_file_outside_is_corrupt(
    tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    where = state / "caches" / "ann" / "index.json"
    index = json.loads(where.read_text())
    (chunk,) = index["chunks"]
    text = json.dumps(index).replace(chunk, "../../../outside.safetensors")
    index = json.loads(text)
    index = _disk.with_digest(index)
    where.write_text(json.dumps(index))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        reply = await rt.agent("ann").ask(question("ann", 1))
        assert reply.usage.cached_tokens == 0  # that cache was not used (nor read)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
async def test_a_corrupt_cache_index_costs_only_that_agents_cache(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(2))
    where = state / "caches" / "ann" / "index.json"
    data = bytearray(where.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x04
    where.write_bytes(bytes(data))
    trace = tmp_path / "trace.jsonl"
    async with Runtime(
        tiny_dir, pool_blocks=100, log_level="off", state_dir=state, trace=trace
    ) as rt:
        ann, bob = rt.agent("ann"), rt.agent("bob")
        assert ann.cached_tokens == 0 and bob.cached_tokens > 0
        reply = await ann.ask(question("ann", 2))
        chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
        assert list(reply.tokens) == chat.turn(render(tiny.tokenizer, ann.history[:-1]), 12)
        assert (await bob.ask(question("bob", 2))).usage.cached_tokens > 0
    lost = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "blocks.lost" and e["agent"] == "ann" for e in lost)


async def test_bit_flips_in_records_are_corrupt_state(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(2))
    rng = random.Random(11)
    for path in [state / "agents" / "ann.json", state / "runtime.json"]:
        good = path.read_bytes()
        for _ in range(12):
            data = bytearray(good)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            with pytest.raises(CorruptStateError, match=path.name):
                async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                    pass
        path.write_bytes(good)
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert len(rt.agent("ann").history) == 5


async def test_a_record_with_text_no_model_can_read_is_corrupt_state(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A lone surrogate (JSON can spell one) in a record with a good checksum: before,
    it loaded, and every turn then failed with the tokenizer's ``TypeError``."""
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    path = state / "agents" / "ann.json"
    good = json.loads(path.read_text())
    for field in ("message", "system"):
        record = {k: v for k, v in good.items() if k != "sha256"}
        if field == "message":
            record["messages"][0] = {**record["messages"][0], "content": "hel\ud800lo"}
        else:
            record["system"] = "You are \udfff."
        path.write_text(json.dumps(_disk.with_digest(record)))
        with pytest.raises(CorruptStateError, match=r"ann\.json.*not valid Unicode"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass


async def test_odd_files_in_the_state_directory_neither_hang_nor_delete(
    tiny_dir: Path, tmp_path: Path
) -> None:
    import os

    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann", "bob"], range(1))
    (state / "caches" / "_blocks" / "index.json").write_text("{}")  # not an agent's
    os.mkfifo(state / "caches" / "bob" / "index.json.fifo")
    (state / "caches" / "bob" / "index.json").unlink()
    os.rename(state / "caches" / "bob" / "index.json.fifo", state / "caches" / "bob" / "index.json")
    with anyio.fail_after(60):  # a FIFO opened for reading would block for ever
        async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
            assert (await rt.agent("ann").ask(question("ann", 1))).usage.cached_tokens > 0
            assert rt.agent("bob").cached_tokens == 0
        os.mkfifo(state / "agents" / "eve.json")
        with pytest.raises(CorruptStateError, match="not a regular file"):
            async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state):
                pass


async def test_records_of_the_older_format_still_open(tiny_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        await converse(rt, ["ann"], range(1))
    path = state / "agents" / "ann.json"
    record = json.loads(path.read_text())
    del record["sha256"]
    record["format"] = 1  # what the older version wrote, with what it accepted
    record["options"].update(seed=-1, stop=[f"stop{i}" for i in range(100)])
    path.write_text(json.dumps(record))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        options = rt.agent("ann").options
        assert options.seed == 2**64 - 1 and len(options.stop) == 64
        await rt.agent("ann").ask(question("ann", 1))


async def test_cache_indexes_of_the_older_format_still_open_and_bad_tokens_cost_the_cache(
    tiny: Loaded, tiny_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        first = await converse(rt, ["ann", "bob"], range(2))
    ann, bob = (state / "caches" / name / "index.json" for name in ("ann", "bob"))
    index = _disk.checked(ann, json.loads(ann.read_text()))
    packed = index["tokens"]
    assert index["format"] == _store.CACHE_FORMAT and isinstance(packed, str)
    tokens = [int(t) for t in np.frombuffer(base64.b64decode(packed), dtype="<u4")]
    # ann's as the older version wrote it (the tokens as numbers); bob's tokens garbled
    ann.write_text(json.dumps(_disk.with_digest({**index, "format": 2, "tokens": tokens})))
    other = _disk.checked(bob, json.loads(bob.read_text()))
    bob.write_text(json.dumps(_disk.with_digest({**other, "tokens": other["tokens"][:-3]})))
    async with Runtime(tiny_dir, pool_blocks=100, log_level="off", state_dir=state) as rt:
        assert rt.agent("ann").cached_tokens == len(tokens)
        assert rt.agent("bob").cached_tokens == 0  # its cache is lost, not its conversation
        replies = await converse(rt, ["ann", "bob"], range(2, 3))
        assert replies["ann", 2].usage.cached_tokens == replies["ann", 2].usage.reusable_tokens > 0
        assert replies["bob", 2].usage.reusable_tokens == 0  # (ann's blocks may serve it)
        for name in ("ann", "bob"):
            chat = ReferenceChat(tiny.model, tiny.tokenizer.eos_token_ids)
            history = rt.agent(name).history
            assert history[2].content == first[name, 0].text
            prompt = render(tiny.tokenizer, history[:-1])
            assert list(replies[name, 2].tokens) == chat.turn(prompt, 12)
