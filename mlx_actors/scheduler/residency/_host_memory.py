"""The host memory that blocks' bits are copied into and back out of: slabs kept for the
process and reused, slot by slot.

Evicting an 8K-token cache of a 16-layer model copies 1,024 arrays (256 MB) to host
memory. Memory fresh from the system costs a page fault per page at its first touch
(on an H200's host, ~100 ms for 256 MB: more than the copy itself), and on MLX's CUDA
backend only page-locked memory mapped into the GPU's address space can be written and
read by a kernel directly (``_transfer``: ~17 GB/s, against ~4 GB/s through MLX's own
buffers). Page-locking is itself slow (~2 GB/s), so neither kind is given back: like
PyTorch's caching host allocator, :class:`HostMemory` keeps the slabs it made and hands
their slots out again.

A slot holds one array (a block's keys or values, or a whole file of blocks read back
from disk). Slots come in power-of-two sizes from 4 KiB up to :data:`SLAB_BYTES`, then
in multiples of it. A slab holds slots of one size: as many as are missing, or as that
size has already (each size's slots double as they are needed), at most
:data:`SLAB_SLOTS` and :data:`SLAB_BYTES` (at least one). A slot taken is given
back when the last numpy array over it is gone, whichever thread drops it (the host
tier, the store's writer): each slot's memory is a ctypes object of its own, and a
finalizer on it returns the slot. The slabs grow up to :attr:`HostMemory.limit` bytes
(raised by each runtime to what its host tier may hold, plus room for caches on their
way to disk); past it, :meth:`HostMemory.take` answers ``None`` and the caller copies
into fresh memory.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

#: Most slots of one slab, and most bytes (a larger slot has a slab of its own).
SLAB_SLOTS = 64
SLAB_BYTES = 64 << 20
#: The smallest slot.
MIN_SLOT = 4096

#: Makes ``nbytes`` of host memory: its address, and an object that keeps it alive.
Allocate = Callable[[int], tuple[int, object]]


def plain_memory(nbytes: int) -> tuple[int, object]:
    """Ordinary host memory starting on a page, its pages touched once so that no copy
    meets a page fault."""
    memory = np.zeros(nbytes + _PAGE, np.uint8)
    address = int(memory.ctypes.data)
    return address + -address % _PAGE, memory


_PAGE = 4096


@attrs.define(eq=False)
class _Slab:
    base: int
    slot: int
    count: int
    owner: object
    free: list[int]
    #: The ctypes type of one slot's memory.
    ctype: Any = None

    def __attrs_post_init__(self) -> None:
        self.ctype = ctypes.c_uint8 * self.slot


class HostMemory:
    """Slabs of host memory, made by ``allocate`` (:func:`plain_memory`, or page-locked
    memory on CUDA), handed out as numpy arrays one slot each. ``mapped``: the GPU
    reaches the slabs at their host addresses."""

    def __init__(self, allocate: Allocate = plain_memory, *, mapped: bool = False) -> None:
        self._allocate = allocate
        self.mapped = mapped
        self.limit = 0
        #: Bytes of the slabs made so far.
        self.nbytes = 0
        self._slabs: dict[int, list[_Slab]] = {}
        self._bases: list[int] = []  # sorted
        self._by_base: dict[int, _Slab] = {}
        # Reentrant: a slot's finalizer (:meth:`_give_back`) can run on a thread that
        # holds the lock, when garbage collection frees the last view of a slot inside
        # :meth:`take` (the collector runs at any allocation there).
        self._lock = threading.RLock()

    def allow(self, nbytes: int) -> None:
        """Let the slabs grow to ``nbytes`` at least (limits only rise)."""
        with self._lock:
            self.limit = max(self.limit, nbytes)

    def take(
        self, arrays: Sequence[tuple[tuple[int, ...], np.dtype[Any]]]
    ) -> list[np.ndarray] | None:
        """An uninitialised array of each ``(shape, dtype)``, each in a slot of its own, or
        ``None`` (nothing taken) if the slabs cannot hold them all within the limit."""
        sizes: dict[tuple[tuple[int, ...], np.dtype[Any]], tuple[int, int]] = {}
        for layout in arrays:  # (elements, slot size), once per distinct layout
            if layout not in sizes:
                count = math.prod(layout[0])
                sizes[layout] = count, _slot_size(count * np.dtype(layout[1]).itemsize)
        with self._lock:
            slots = self._take_slots([sizes[layout][1] for layout in arrays])
        if slots is None:
            return None
        out = []
        give_back = self._give_back
        for layout, (slab, index) in zip(arrays, slots, strict=True):
            shape, dtype = layout
            memory = slab.ctype.from_address(slab.base + index * slab.slot)
            weakref.finalize(memory, give_back, slab, index)
            out.append(np.frombuffer(memory, dtype, sizes[layout][0]).reshape(shape))
        return out

    def holds(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies within one of the slabs, in one piece."""
        if not a.flags.c_contiguous:
            return False
        start = int(a.ctypes.data)
        with self._lock:
            at = bisect.bisect_right(self._bases, start) - 1
            if at < 0:
                return False
            slab = self._by_base[self._bases[at]]
            return start + a.nbytes <= slab.base + slab.slot * slab.count

    def free_bytes(self) -> int:
        """Bytes of slots free in the slabs made so far."""
        with self._lock:
            return sum(len(s.free) * s.slot for slabs in self._slabs.values() for s in slabs)

    def _take_slots(self, sizes: list[int]) -> list[tuple[_Slab, int]] | None:
        wanted: dict[int, int] = {}
        for size in sizes:
            wanted[size] = wanted.get(size, 0) + 1
        for size, n in wanted.items():  # make the slabs first: all or nothing
            slabs = self._slabs.get(size, [])
            have = sum(len(s.free) for s in slabs)
            most = max(1, min(SLAB_SLOTS, SLAB_BYTES // size))
            while have < n:
                # as many slots as are missing, or as the size has already (it doubles)
                per = min(most, max(n - have, sum(s.count for s in slabs)))
                if self.nbytes + per * size > self.limit:
                    per = min(most, n - have)  # near the limit: only what is missing
                if self.nbytes + per * size > self.limit:
                    return None
                base, owner = self._allocate(per * size)
                slab = _Slab(base, size, per, owner, list(range(per - 1, -1, -1)))
                slabs.append(slab)
                self._slabs[size] = slabs
                bisect.insort(self._bases, base)
                self._by_base[base] = slab
                self.nbytes += per * size
                have += per
        taken = []
        free = {size: iter(self._slabs[size]) for size in wanted}
        current: dict[int, _Slab] = {}
        for size in sizes:
            at = current.get(size)
            while at is None or not at.free:  # the slabs made above hold them all
                at = current[size] = next(free[size])
            taken.append((at, at.free.pop()))
        return taken

    def _give_back(self, slab: _Slab, index: int) -> None:
        with self._lock:
            slab.free.append(index)


def _slot_size(nbytes: int) -> int:
    if nbytes > SLAB_BYTES:
        return -(-nbytes // SLAB_BYTES) * SLAB_BYTES
    return max(MIN_SLOT, 1 << (max(nbytes, 1) - 1).bit_length())
