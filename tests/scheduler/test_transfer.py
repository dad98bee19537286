"""Cache blocks copied to host memory and back (``scheduler/residency/_transfer.py``): bit for bit,
into slots of host memory that are reused (``_host_memory.py``).

On this machine the copies are numpy's and MLX's own (``np.copyto``, ``mx.array``); on
MLX's CUDA backend the same tests run the module's kernels over page-locked memory (and
the CUDA driver's copies for other host arrays), which must give the same bits.
"""

from __future__ import annotations

import gc
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_actors import Runtime
from mlx_actors.runtime import _store
from mlx_actors.runtime._disk import checksum, read_safetensors, safetensors_bytes
from mlx_actors.scheduler.residency import _transfer, to_device, to_host
from mlx_actors.scheduler.residency._host_memory import HostMemory, plain_memory


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostMemory]:
    """The process's host memory for copies: a fresh one (the CUDA GPU's own, page-locked
    and kept for the process, on such a machine), with room for a few MB."""
    memory = _transfer.host_memory()
    if memory is None or not memory.mapped:
        memory = HostMemory()
        monkeypatch.setattr(_transfer, "_memory", [memory])
    memory.allow(64 << 20)
    yield memory


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_round_trip_is_bit_exact(dtype: type) -> None:
    rng = np.random.default_rng(7)
    host = [rng.integers(0, np.iinfo(dtype).max, (1, 4, 256, 16), dtype=dtype) for _ in range(5)]
    device = to_device(host)
    assert [a.dtype for a in device] == [mx.array(h).dtype for h in host]
    # Computed on the device, then copied back: the same bits.
    doubled = [a + a for a in device]
    mx.eval(doubled)
    back = to_host(doubled)
    for h, b in zip(host, back, strict=True):
        assert b.dtype == h.dtype and b.shape == h.shape
        np.testing.assert_array_equal(b, h + h)


def test_views_and_pieces_of_a_bigger_cache() -> None:
    cache = mx.random.normal((1, 4, 512, 16)).astype(mx.bfloat16)
    piece = mx.contiguous(cache[..., 256:, :]).view(mx.uint16)
    mx.eval(piece)
    (copy,) = to_host([piece])
    np.testing.assert_array_equal(copy, np.array(piece))
    (again,) = to_device([copy])
    assert mx.array_equal(again.view(mx.bfloat16), cache[..., 256:, :]).item()


def test_a_non_contiguous_host_array_is_copied_as_its_values() -> None:
    host = np.arange(4 * 256 * 16, dtype=np.uint16).reshape(4, 256, 16)[:, ::2, :]
    (device,) = to_device([host])
    np.testing.assert_array_equal(np.array(device), host)


def test_many_blocks_of_mixed_sizes_through_several_staging_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, blocks go to the device and back through staging buffers of at most
    ``STAGING_BYTES`` (one larger block alone): every block's bits arrive, in order."""
    monkeypatch.setattr(_transfer, "STAGING_BYTES", 100_000)
    rng = np.random.default_rng(3)
    shapes = [(1, 2, 256, 16), (1, 3, 77, 5), (1, 8, 256, 64), (3, 7)]
    host = [
        rng.integers(0, np.iinfo(dtype).max, shapes[i % len(shapes)], dtype=dtype)
        for i, dtype in enumerate([np.uint16, np.uint8, np.uint32] * 13)
    ]
    groups = _transfer._groups(host)
    flat = [h for group in groups for h in group]
    assert len(flat) == len(host) and all(a is b for a, b in zip(flat, host, strict=True))
    assert len(groups) > 3
    for group in groups:
        padded = sum(-h.nbytes % 256 + h.nbytes for h in group)
        assert len(group) == 1 or padded <= _transfer.STAGING_BYTES
    device = to_device(host)
    for h, d in zip(host, device, strict=True):
        assert d.dtype == mx.array(h).dtype
        np.testing.assert_array_equal(np.array(d), h)
    again = [d + d for d in device]  # made on the device
    mx.eval(again)
    for h, b in zip(host, to_host(again), strict=True):
        assert b.dtype == h.dtype and b.shape == h.shape
        np.testing.assert_array_equal(b, h + h)


def test_copies_go_into_slots_that_come_back_when_the_last_view_is_gone(
    memory: HostMemory,
) -> None:
    rng = np.random.default_rng(5)
    host = [rng.integers(0, 60_000, (1, 4, 256, 16), dtype=np.uint16) for _ in range(6)]
    slot = host[0].nbytes  # a power of two: a slot each, exactly
    device = to_device(host)
    free, made = memory.free_bytes(), memory.nbytes
    back = to_host(device)
    assert all(memory.holds(b) for b in back)
    assert len({b.ctypes.data for b in back}) == len(back)
    for i, h in enumerate(host):
        np.testing.assert_array_equal(back[i], h)
    taken = memory.free_bytes()
    assert taken == free + (memory.nbytes - made) - 6 * slot
    # A view keeps its slot taken; the slot is free again once the view is gone too,
    # whichever thread lets it go.
    view = back[0].view(np.uint8)[1:]
    del back
    gc.collect()
    assert memory.free_bytes() == taken + 5 * slot
    holder = [view]
    del view
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    gc.collect()
    assert memory.free_bytes() == taken + 6 * slot
    # Copies out again reuse the slabs made: no new memory.
    made = memory.nbytes
    again = to_host(device)
    assert memory.nbytes == made and all(memory.holds(b) for b in again)


@pytest.mark.timeout(60)
def test_a_slot_given_back_by_the_collector_while_slots_are_taken() -> None:
    """The garbage collector may free the last view of a slot while the same thread
    takes slots (it runs at any allocation, here the slab's): the slot comes back, and
    the taking goes on (it deadlocked on the lock the taking held)."""

    def collecting(nbytes: int) -> tuple[int, object]:
        gc.collect()  # as the collector would, at this allocation
        return plain_memory(nbytes)

    memory = HostMemory(collecting)
    memory.allow(1 << 20)
    taken = memory.take([((1024,), np.dtype(np.uint32))])  # a 4 KiB slot
    assert taken is not None
    cycle: list[object] = [taken[0]]
    cycle.append(cycle)  # only the collector frees it
    del taken, cycle
    more = memory.take([((8192,), np.dtype(np.uint8))])  # another size: a new slab
    assert more is not None and memory.free_bytes() == 4096


def test_past_its_limit_host_memory_takes_nothing_and_copies_go_to_fresh_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = HostMemory()
    memory.allow(64 * 4096)
    first = memory.take([((1024,), np.dtype(np.uint32))] * 48)  # 4 KiB slots
    assert first is not None and memory.nbytes == 48 * 4096
    more = memory.take([((1000,), np.dtype(np.uint32))] * 16)
    assert more is not None and memory.nbytes == 64 * 4096
    assert memory.take([((1024,), np.dtype(np.uint32))] * 5) is None
    assert memory.take([((8192,), np.dtype(np.uint8))]) is None  # another size: a new slab
    assert memory.take([((5,), np.dtype(np.uint8)), ((8192,), np.dtype(np.uint8))]) is None
    assert memory.free_bytes() == 0  # nothing was taken by the refusals
    del first
    again = memory.take([((512,), np.dtype(np.uint64))] * 48)  # the freed slots
    assert again is not None and memory.nbytes == 64 * 4096
    current = _transfer.host_memory()
    if current is None or not current.mapped:  # (a CUDA GPU's memory is page-locked)
        monkeypatch.setattr(_transfer, "_memory", [memory])
        device = [mx.arange(1024, dtype=mx.uint32) for _ in range(5)]
        mx.eval(device)
        out = to_host(device)
        assert not any(memory.holds(o) for o in out)
        for o in out:
            np.testing.assert_array_equal(o, np.arange(1024, dtype=np.uint32))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_evictions_reuse_the_same_host_memory(
    tiny_dir: Path, tmp_path: Path, memory: HostMemory
) -> None:
    """Two agents take turns in a pool that holds one: every turn moves the other's cache
    out to host memory (kept there while the host tier's budget allows, and written to
    disk) and brings its own back, through slots used again."""
    trace = tmp_path / "trace.jsonl"
    brief = "You are {}. " + " ".join(f"rule{i}" for i in range(40))
    async with Runtime(tiny_dir, pool_blocks=14, log_level="off", trace=trace) as rt:
        a = await rt.spawn("a", system=brief.format("a"), max_tokens=8)
        b = await rt.spawn("b", system=brief.format("b"), max_tokens=8)
        for turn in range(12):
            await a.ask(f"Question {turn} for a.")
            await b.ask(f"Question {turn} for b.")
        await rt.flush()
        stats = await rt.stats()
    assert stats.evictions >= 20 and stats.restores >= 20
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    evicted = sum(e["bytes"] for e in events if e["event"] == "blocks.evicted")
    # Without slots given back, the slabs would hold at least every byte evicted.
    assert 0 < memory.nbytes < evicted / 2


def test_chunk_files_are_read_into_host_memory_their_tensors_aligned(
    tmp_path: Path, memory: HostMemory
) -> None:
    """A cache file read back lands in a slot (page-locked on CUDA: its blocks go to the
    GPU by the kernel), each tensor 64-byte aligned; files whose header was padded to 8
    bytes only (written before) still read."""
    rng = np.random.default_rng(11)
    tensors = {
        "0.keys": rng.integers(0, 60_000, (1, 2, 256, 16), dtype=np.uint16),
        "0.values": rng.integers(0, 60_000, (1, 2, 256, 16), dtype=np.uint16),
        "1.keys": rng.integers(0, 60_000, (1, 2, 100, 16), dtype=np.uint16),
    }
    data = b"".join(safetensors_bytes(tensors, "bfloat16", {"who": "test"}))
    path = tmp_path / "chunk-0.safetensors"
    path.write_bytes(data)
    read, dtype = read_safetensors(path, checksum(data), _store._host_buffer)
    assert dtype == "bfloat16"
    for name, a in tensors.items():
        np.testing.assert_array_equal(read[name], a)
        assert memory.holds(read[name]) and read[name].ctypes.data % 64 == 0
    back = to_device(list(read.values()))
    for a, b in zip(tensors.values(), back, strict=True):
        np.testing.assert_array_equal(np.array(b), a)
    (size,) = struct.unpack_from("<Q", data)
    header = data[8 : 8 + size].rstrip()
    header += b" " * (-len(header) % 8)
    old = tmp_path / "chunk-1.safetensors"
    old.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + size :])
    again, _ = read_safetensors(old, None, _store._host_buffer)
    for name, a in tensors.items():
        np.testing.assert_array_equal(again[name], a)
