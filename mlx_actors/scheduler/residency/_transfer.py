"""Copies of cache blocks between host memory (numpy) and the device, on the engine thread.

Host copies go into slots of the process's :class:`~._host_memory.HostMemory`
(:func:`host_memory`), reused from one eviction to the next, and fall back to fresh
arrays when its slabs are full. Everywhere but MLX's CUDA backend the copies are
``np.copyto`` out and ``mx.array(bits)`` in.

On CUDA the slabs are page-locked host memory mapped into the GPU's address space
(``cuMemHostAlloc``), and the kernels of :mod:`._host_kernels` copy the arrays between
their slots and the device, many blocks per launch, on MLX's own stream: an 8K-token
cache of a 16-layer model (256 MB) goes out in ~33 ms on an H200 and back in ~22 ms,
against 60-380 ms and ~78 ms by the driver's copies below. Host arrays that are not in
a slot (the slabs were full, or a cache file written before its tensors were aligned)
go the driver's way.

On CUDA (MLX 0.32), an array made from host memory lives in unified (managed) memory:
written on the host, it moves to the GPU page by page when a kernel first reads it
(about 1.3 GB/s on an H100). Arrays a kernel made live in device memory; exporting one
(its buffer, for numpy or for a pointer) first moves it into unified memory with a
device copy. There this module copies with the CUDA driver's copy engine instead:
``cuMemcpyHtoDAsync`` into buffers MLX allocated and filled on the device (exported,
so in unified memory whose pages are on the GPU), ``cuMemcpyDtoHAsync`` out of them,
on a stream of its own. The driver is reached through ``ctypes`` (MLX exposes
no such copy); a pointer is used only once the driver confirms it is managed memory of
the right size. Any failure (no driver, a driver error, a buffer that is not MLX's)
falls back to the plain copies for the whole batch, and ``MLX_ACTORS_CUDA_COPIES=0``
turns the driver path off.

Blocks come back many at a time (an 8K-token cache of a 16-layer model is 1,024 arrays),
and each buffer made, exported and checked costs far more than its copy; so the copies
go to the device through one staging buffer per :data:`STAGING_BYTES`: every block's
bits copied into it by the driver, then split on the device into arrays of their own
(one device copy each), and the staging buffer freed. (The other way, putting the
blocks together on the device first was slower on an H100 than exporting each.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from . import _host_kernels
from ._host_kernels import MX_BITS, NP_BITS
from ._host_memory import HostMemory

#: Bytes of one staging buffer (at most, unless one block is larger).
STAGING_BYTES = 64 << 20
#: Where each block starts in a staging buffer: a multiple of this.
_ALIGN = 256

_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_STREAM_NON_BLOCKING = 1
_CU_MEMHOSTALLOC_PORTABLE = 1
_CU_MEMHOSTALLOC_DEVICEMAP = 2


class _CopyFailed(Exception):
    pass


class _Driver:
    """The few CUDA driver calls the copies need, on one non-blocking stream."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        ptr, size, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cuStreamSynchronize.argtypes = [vp]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ptr, vp, size, vp]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, ptr, size, vp]
        lib.cuPointerGetAttribute.argtypes = [vp, ctypes.c_int, ptr]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), size, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ptr), vp, ctypes.c_uint]
        self._lib = lib
        self._check(lib.cuInit(0), "cuInit")
        self._context = self._current_context()
        if not self._context:
            raise _CopyFailed("no CUDA context is current (MLX has not used the GPU)")
        stream = vp()
        self._check(lib.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING), "stream")
        self._stream = stream

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise _CopyFailed(f"{what}: CUDA driver error {result}")

    def _current_context(self) -> int:
        context = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        return context.value or 0

    def enter(self) -> None:
        """Make MLX's context (the device's primary one) current on this thread."""
        current = self._current_context()
        if current == 0:
            self._check(self._lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        elif current != self._context:
            raise _CopyFailed("another CUDA context is current on this thread")

    def device_pointer(self, a: mx.array) -> int:
        view = memoryview(cast(Any, a))  # MLX arrays export their buffer
        if not view.c_contiguous or view.nbytes != a.nbytes:
            raise _CopyFailed("the buffer is not one contiguous piece")
        address: int = np.frombuffer(view, dtype=np.uint8).ctypes.data
        managed = ctypes.c_uint32()
        self._check(
            self._lib.cuPointerGetAttribute(
                ctypes.byref(managed), _CU_POINTER_ATTRIBUTE_IS_MANAGED, address
            ),
            "cuPointerGetAttribute",
        )
        extent = ctypes.c_uint64()
        self._check(
            self._lib.cuPointerGetAttribute(
                ctypes.byref(extent), _CU_POINTER_ATTRIBUTE_RANGE_SIZE, address
            ),
            "cuPointerGetAttribute",
        )
        if managed.value != 1 or extent.value < a.nbytes:
            raise _CopyFailed("the buffer is not CUDA managed memory of the array's size")
        return address

    def to_device(self, host: np.ndarray, device: int) -> None:
        self._check(
            self._lib.cuMemcpyHtoDAsync_v2(device, host.ctypes.data, host.nbytes, self._stream),
            "cuMemcpyHtoDAsync",
        )

    def to_host(self, device: int, host: np.ndarray) -> None:
        self._check(
            self._lib.cuMemcpyDtoHAsync_v2(host.ctypes.data, device, host.nbytes, self._stream),
            "cuMemcpyDtoHAsync",
        )

    def synchronize(self) -> None:
        self._check(self._lib.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def host_alloc(self, nbytes: int) -> tuple[int, object]:
        """``nbytes`` of page-locked host memory that kernels reach at its host address
        (kept for the process's life)."""
        self.enter()
        memory = ctypes.c_void_p()
        flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(memory), nbytes, flags), "cuMemHostAlloc")
        address = memory.value or 0
        device = ctypes.c_uint64()
        self._check(
            self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device), address, 0),
            "cuMemHostGetDevicePointer",
        )
        if device.value != address:  # a kernel is handed the host address
            raise _CopyFailed("page-locked memory is mapped at another address on the GPU")
        return address, memory


_lock = threading.Lock()
_loaded: list[_Driver | None] = []


def _driver() -> _Driver | None:
    """The driver path, if MLX computes on a CUDA GPU here and the driver answers."""
    if os.environ.get("MLX_ACTORS_CUDA_COPIES", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            driver = None
            if mx.cuda.is_available() and mx.default_device().type == mx.gpu:
                mx.eval(mx.zeros((1,)))  # MLX makes its context current on this thread
                try:
                    driver = _Driver()
                except (OSError, AttributeError, _CopyFailed):
                    driver = None
            _loaded.append(driver)
        return _loaded[0]


_memory: list[HostMemory | None] = []


def host_memory(*, start: bool = True) -> HostMemory | None:
    """The process's host memory for blocks' bits: page-locked and mapped on a CUDA GPU,
    ordinary elsewhere; ``None`` on a CUDA GPU whose driver path is off or failed, or,
    with ``start=False``, before an engine thread started it (starting it may run MLX
    work, which belongs on that thread)."""
    with _lock:
        if _memory or not start:
            return _memory[0] if _memory else None
    memory: HostMemory | None = HostMemory()
    if mx.cuda.is_available() and mx.default_device().type == mx.gpu:
        driver = _driver()
        memory = None if driver is None else HostMemory(driver.host_alloc, mapped=True)
    with _lock:
        if not _memory:
            _memory.append(memory)
        return _memory[0]


def to_device(host: Sequence[np.ndarray]) -> list[mx.array]:
    """MLX arrays equal to ``host`` (unsigned bits), on the device."""
    host = [np.ascontiguousarray(h) for h in host]
    memory = host_memory()
    if memory is not None and memory.mapped and host and all(map(memory.holds, host)):
        copied = _host_kernels.copy(host, [])
        if copied is not None:
            return copied
    driver = _driver()
    if driver is not None and host:
        try:
            driver.enter()
            out: list[mx.array] = []
            for group in _groups(host):
                out.extend(_staged(driver, group))
            return out
        except _CopyFailed:
            _settle(driver)
        except BaseException:
            _settle(driver)  # no copy may still write into buffers MLX gets back
            raise
    return [mx.array(h) for h in host]


def _groups(host: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """``host`` in order, in runs of at most :data:`STAGING_BYTES` (a larger array alone)."""
    groups: list[list[np.ndarray]] = [[]]
    size = 0
    for h in host:
        if groups[-1] and size + _room(h) > STAGING_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(h)
        size += _room(h)
    return groups


def _room(h: np.ndarray) -> int:
    """Bytes ``h`` takes in a staging buffer: its own, up to the next start."""
    return -h.nbytes % _ALIGN + h.nbytes


def _staged(driver: _Driver, host: Sequence[np.ndarray]) -> list[mx.array]:
    """``host`` copied into one staging buffer by the driver, then into arrays of their
    own by the device."""
    starts, size = [], 0
    for h in host:
        starts.append(size)
        size += _room(h)
    staging = mx.zeros((size,), mx.uint8)
    mx.eval(staging)
    _synchronize()
    base = driver.device_pointer(staging)
    for h, start in zip(host, starts, strict=True):
        driver.to_device(h, base + start)
    driver.synchronize()
    zero = {dtype: mx.array(0, MX_BITS[dtype]) for dtype in {h.dtype for h in host}}
    out = [
        # a view of the staging buffer, then its bits in a buffer of its own
        staging[start : start + h.nbytes].view(MX_BITS[h.dtype]).reshape(h.shape) + zero[h.dtype]
        for h, start in zip(host, starts, strict=True)
    ]
    mx.eval(out)
    return out


def to_host(arrays: Sequence[mx.array]) -> list[np.ndarray]:
    """numpy copies of ``arrays`` (unsigned bits, evaluated): in slots of
    :func:`host_memory` while it has room."""
    memory = host_memory()
    slots = None if memory is None or not arrays else memory.take(_layout(arrays))
    if slots is not None and memory is not None:
        if not memory.mapped:
            for a, h in zip(arrays, slots, strict=True):
                np.copyto(h, np.asarray(a))
            return slots
        if _host_kernels.copy(slots, arrays) is not None:
            return slots
    driver = _driver()
    if driver is not None and arrays:
        # Exporting a buffer moves it (and frees the old one): nothing may still read it.
        _synchronize()
        out = [np.empty(a.shape, NP_BITS[a.dtype]) for a in arrays]
        try:
            driver.enter()
            for a, h in zip(arrays, out, strict=True):
                driver.to_host(driver.device_pointer(a), h)
            driver.synchronize()
            return out
        except _CopyFailed:
            _settle(driver)
        except BaseException:
            _settle(driver)
            raise
    return [np.array(a) for a in arrays]


def _layout(arrays: Sequence[mx.array]) -> list[tuple[tuple[int, ...], np.dtype[Any]]]:
    return [(tuple(a.shape), NP_BITS[a.dtype]) for a in arrays]


def compile_kernels() -> None:
    """Have MLX compile the kernels of :mod:`._host_kernels`, if copies use them (a CUDA
    GPU with the driver path)."""
    memory = host_memory()
    if memory is not None and memory.mapped:
        _host_kernels.compile_kernels()


def _synchronize() -> None:
    """Wait for MLX's work on this thread's streams: the default one and mlx-lm's."""
    mx.synchronize()
    mx.synchronize(generation_stream)


def _settle(driver: _Driver) -> None:
    """After a failed batch: wait for what was queued before copying the plain way."""
    with contextlib.suppress(_CopyFailed):
        driver.synchronize()
