"""Kernels that copy blocks between the device and host memory mapped into the GPU's
address space (slots of :class:`~._host_memory.HostMemory` on CUDA): out, each block's
device array written to its slot; in, each slot read into a device array of its own.
A launch takes :data:`WIDTH` arrays as arguments of its own (inputs out, outputs in)
and a table of each one's host address and bytes, on MLX's stream; nothing MLX holds
is exported, and no buffer is put together or split on the device (on an H200, 1,024
arrays of 256 KiB: out 33 ms, in 22 ms, against 44 and 30 ms that way). A kernel MLX
cannot compile or launch turns them off for the process (:data:`failed`), and
:mod:`._transfer` copies the other way."""

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


def copy(host: Sequence[np.ndarray], device: Sequence[mx.array]) -> list[mx.array] | None:
    """With ``device``: its arrays copied into ``host`` (slots of the mapped host
    memory, as many, in order); without: new device arrays equal to ``host``. A launch
    per :data:`WIDTH` arrays; ``None`` (nothing copied) if a size or an address does
    not suit the 16-byte copies, or the kernels failed before."""
    if failed or any(h.nbytes % 16 or h.ctypes.data % 16 for h in host):
        return None
    out: list[mx.array] = []
    done = []
    try:
        for start in range(0, len(host), WIDTH):
            launch = host[start : start + WIDTH]
            if device:
                done.append(_launch_out(launch, device[start : start + WIDTH]))
            else:
                out.extend(_launch_in(launch))
        mx.eval(done or out)
        mx.synchronize()  # the kernels' writes to host memory are done
    except RuntimeError as exc:  # MLX could not compile or launch them: copy otherwise
        failed.append(repr(exc))
        return None
    return out


#: Why the kernels failed, if they did (then the process copies without them).
failed: list[str] = []


#: Arrays per launch: each one argument of the kernel (a device array taken, out, or
#: made, in), chosen by the launch's ``blockIdx.y``.
WIDTH = 32


def _source(direction: str) -> str:
    """A kernel's body over :data:`WIDTH` device arrays (``a0``...), ``table``: per array
    its host address and bytes (0 for the arrays that pad a launch)."""
    cases = " ".join(f"case {i}: a = a{i}; break;" for i in range(WIDTH))
    if direction == "out":
        pick = f"const void* a = nullptr; switch (blockIdx.y) {{ {cases} }}"
        ends = "const uint4* s = reinterpret_cast<const uint4*>(a);\n"
        ends += "    uint4* d = reinterpret_cast<uint4*>(e[0]);"
    else:
        pick = f"void* a = nullptr; switch (blockIdx.y) {{ {cases} }}"
        ends = "const uint4* s = reinterpret_cast<const uint4*>(e[0]);\n"
        ends += "    uint4* d = reinterpret_cast<uint4*>(a);"
    done = "if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) { done[0] = 1; }"
    return f"""
    const int64_t* e = table + 2 * blockIdx.y;
    {pick}
    {ends}
    const int64_t n = e[1] / 16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {{
        d[i] = s[i];
    }}
    {done if direction == "out" else ""}
"""


_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        names = [f"a{i}" for i in range(WIDTH)]
        if name == "out":
            inputs, outputs = ["table", *names], ["done"]
        else:
            inputs, outputs = ["table"], names
        kernel = _kernels[name] = mx.fast.cuda_kernel(
            name=f"mlx_actors_host_{name}",
            input_names=inputs,
            output_names=outputs,
            source=_source(name),
        )
    return kernel


def _threads(host: Sequence[np.ndarray]) -> int:
    """Threads per array: one 16-byte piece each, up to 64 blocks of 256."""
    most = max((h.nbytes for h in host), default=16) // 16
    return 256 * max(1, min(64, -(-most // 256)))


def _launch_out(host: Sequence[np.ndarray], device: Sequence[mx.array]) -> mx.array:
    """One launch: each of ``device`` (at most :data:`WIDTH`) written into its ``host``."""
    pad = WIDTH - len(host)
    table: list[int] = []
    for h in host:
        table += (h.ctypes.data, h.nbytes)
    table += (0, 0) * pad
    (done,) = _kernel("out")(
        inputs=[mx.array(table, dtype=mx.int64), *device, *[_nothing()] * pad],
        grid=(_threads(host), WIDTH, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint8],
    )
    return cast(mx.array, done)


def _launch_in(host: Sequence[np.ndarray]) -> list[mx.array]:
    """One launch: each of ``host`` (at most :data:`WIDTH`) read into an array of its own."""
    pad = WIDTH - len(host)
    table: list[int] = []
    for h in host:
        table += (h.ctypes.data, h.nbytes)
    table += (0, 0) * pad
    out = _kernel("in")(
        inputs=[mx.array(table, dtype=mx.int64)],
        grid=(_threads(host), WIDTH, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[h.shape for h in host] + [(16,)] * pad,
        output_dtypes=[MX_BITS[h.dtype] for h in host] + [mx.uint8] * pad,
    )
    return list(out[: len(host)])


def _nothing() -> mx.array:
    """The 16 bytes that pad a launch's arrays."""
    if not _pad:
        _pad.append(mx.zeros((16,), mx.uint8))
    return _pad[0]


_pad: list[mx.array] = []


def compile_kernels() -> None:
    """Have MLX compile the kernels: each launched once with nothing to copy."""
    try:
        made = _kernel("in")(
            inputs=[mx.zeros((2 * WIDTH,), mx.int64)],
            grid=(256, WIDTH, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(16,)] * WIDTH,
            output_dtypes=[mx.uint8] * WIDTH,
        )
        mx.eval(*made, _launch_out([], []))
    except RuntimeError as exc:
        failed.append(repr(exc))
