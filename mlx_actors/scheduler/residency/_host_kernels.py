"""Kernels that copy blocks between the device and host memory mapped into the GPU's
address space (slots of :class:`~._host_memory.HostMemory` on CUDA): out, blocks put
together on the device and written to their slots by a table of (offset, address,
bytes); in, slots read into one device buffer by a table of (address, offset, bytes),
then split into the blocks' own arrays. One launch per group of blocks, on MLX's
stream; nothing MLX holds is exported. A kernel MLX cannot compile or launch turns them
off for the process (:data:`failed`), and :mod:`._transfer` copies the other way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

#: Unsigned types of a block's bits, numpy to MLX.
MX_BITS: dict[np.dtype[Any], mx.Dtype] = {
    np.dtype(np.uint8): mx.uint8,
    np.dtype(np.uint16): mx.uint16,
    np.dtype(np.uint32): mx.uint32,
}
NP_BITS: dict[mx.Dtype, np.dtype[Any]] = {v: k for k, v in MX_BITS.items()}


def copy(
    groups: Sequence[Sequence[np.ndarray]], device: Sequence[mx.array]
) -> list[mx.array] | None:
    """With ``device``: its arrays copied into the host arrays of ``groups`` (slots of
    the mapped host memory, as many, in order); without: new device arrays equal to
    them. A launch per group; ``None`` (nothing copied) if a size or an address does
    not suit the 16-byte copies, or the kernels failed before."""
    if failed or any(h.nbytes % 16 or h.ctypes.data % 16 for g in groups for h in g):
        return None
    out: list[mx.array] = []
    done = []
    start = 0
    try:
        for group in groups:
            stop = start + len(group)
            if device:
                done.append(_launch_out(group, device[start:stop]))
            else:
                out.extend(_launch_in(group))
            start = stop
        mx.eval(done or out)
        mx.synchronize()  # the kernels' writes to host memory are done
    except RuntimeError as exc:  # MLX could not compile or launch them: copy otherwise
        failed.append(repr(exc))
        return None
    return out


#: Why the kernels failed, if they did (then the process copies without them).
failed: list[str] = []


_SOURCE_OUT = """
    const int64_t* e = table + 3 * blockIdx.y;
    const uint4* s = reinterpret_cast<const uint4*>(src + e[0]);
    uint4* d = reinterpret_cast<uint4*>(e[1]);
    const int64_t n = e[2] / 16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        d[i] = s[i];
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        done[0] = 1;
    }
"""

_SOURCE_IN = """
    const int64_t* e = table + 3 * blockIdx.y;
    const uint4* s = reinterpret_cast<const uint4*>(e[0]);
    uint4* d = reinterpret_cast<uint4*>(o + e[1]);
    const int64_t n = e[2] / 16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        d[i] = s[i];
    }
"""

_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        if name == "out":
            inputs, outputs, source = ["src", "table"], ["done"], _SOURCE_OUT
        else:
            inputs, outputs, source = ["table"], ["o"], _SOURCE_IN
        kernel = _kernels[name] = mx.fast.cuda_kernel(
            name=f"mlx_actors_host_{name}",
            input_names=inputs,
            output_names=outputs,
            source=source,
        )
    return kernel


def _threads(host: Sequence[np.ndarray]) -> int:
    """Threads per array: one 16-byte piece each, up to 64 blocks of 256."""
    most = max(h.nbytes for h in host) // 16
    return 256 * max(1, min(64, -(-most // 256)))


def _launch_out(host: Sequence[np.ndarray], device: Sequence[mx.array]) -> mx.array:
    """One launch: ``device`` (put together on the device) written into ``host``."""
    src = mx.concatenate([a.reshape(-1).view(mx.uint8) for a in device])
    table: list[int] = []
    offset = 0
    for h in host:
        table += (offset, h.ctypes.data, h.nbytes)
        offset += h.nbytes
    (done,) = _kernel("out")(
        inputs=[src, mx.array(table, dtype=mx.int64)],
        grid=(_threads(host), len(host), 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint8],
    )
    return cast(mx.array, done)


def _launch_in(host: Sequence[np.ndarray]) -> list[mx.array]:
    """One launch: ``host`` read into one device buffer, then an array of its own each."""
    table: list[int] = []
    offset = 0
    for h in host:
        table += (h.ctypes.data, offset, h.nbytes)
        offset += h.nbytes
    (staged,) = _kernel("in")(
        inputs=[mx.array(table, dtype=mx.int64)],
        grid=(_threads(host), len(host), 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(offset,)],
        output_dtypes=[mx.uint8],
    )
    out = []
    offset = 0
    for h in host:
        bits = MX_BITS[h.dtype]
        # a view of the staged bytes, then its bits in a buffer of its own
        piece = staged[offset : offset + h.nbytes].view(bits).reshape(h.shape)
        out.append(piece + mx.array(0, bits))
        offset += h.nbytes
    return out


def compile_kernels() -> None:
    """Have MLX compile the kernels: each launched once with nothing to copy."""
    nothing = mx.array([0, 0, 0], dtype=mx.int64)
    shapes = {"out": [(1,)], "in": [(16,)]}
    try:
        for name, inputs in (("out", [mx.zeros((16,), mx.uint8), nothing]), ("in", [nothing])):
            mx.eval(
                _kernel(name)(
                    inputs=inputs,
                    grid=(256, 1, 1),
                    threadgroup=(256, 1, 1),
                    output_shapes=shapes[name],
                    output_dtypes=[mx.uint8],
                )
            )
    except RuntimeError as exc:
        failed.append(repr(exc))
