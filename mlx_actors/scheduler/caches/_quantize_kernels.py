"""The two conversions of the dequantized path (:mod:`._dequantized`): new keys and
values to the packed form blocks keep (and back, for the model), and a packed cache to
what the model attends over. On a CUDA GPU each is one kernel launch for keys and values
together; elsewhere MLX's own ops.

- :func:`quantize_step`: keys and values quantized as ``mx.quantize`` does, packed
  (:func:`~._quantized.pack`), and dequantized; with MLX's ops five kernels per array
  (quantize, the packing copy, dequantize; the writes into the cache follow), for every
  layer and decoding step, so that on a GPU a quantized batch's step is launches more
  than arithmetic.
- :func:`dequantize_pair`: packed keys and values dequantized whole, when a cache's
  arrays were replaced (a prefill, growth, a move through the batch, a rebuild from
  blocks); with MLX's ops four kernels per array (the three copies that unpack the
  triple, then dequantize).

The kernels do MLX's CUDA arithmetic (``affine_quantize`` and ``affine_dequantize`` in
``mlx/backend/cuda/quantized/affine_quantize.cu``, 0.32) bit for bit; quantizing takes a
thread per group of values instead of a warp (a group's minimum and maximum do not
depend on the order they are taken in). ``benchmarks/quantize_kernels.py`` checks them
against MLX's ops on the GPU, and each kernel checks itself once per combination of
dtype, bits, group size and head sizes at first use: where its bits differ from MLX's
ops, or it cannot be compiled, MLX's ops are used. Inputs that are not row-contiguous
are copied first (by MLX, inside the launch). No library does this for MLX; the kernels
are about 80 lines.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._gather import kernel_available  # a CUDA GPU: where MLX runs custom kernels
from ._quantized import KVQuantization, pack, unpack

#: A step's keys and values packed, then dequantized.
Step = tuple[mx.array, mx.array, mx.array, mx.array]

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_kernels: dict[str, Any] = {}
#: Whether each kernel gave MLX's bits, by kernel, dtype, quantization and head sizes.
_agrees: dict[tuple[Any, ...], bool] = {}


def quantize_step(keys: mx.array, values: mx.array, q: KVQuantization) -> Step:
    """``keys`` and ``values`` quantized as ``mx.quantize`` does, packed, and what they
    hold, dequantized (with MLX's ops, only computed if used)."""
    dk, dv, dtype = int(keys.shape[-1]), int(values.shape[-1]), keys.dtype
    if values.dtype == dtype and _use_kernel("quantize", keys, values, dk, dv, dtype, q):
        pk, pv, outk, outv = _launch("quantize", keys, values, dk, dv, dtype, q)
        return pk, pv, outk, outv
    return _quantize_with_ops(keys, values, q)


def dequantize_pair(
    keys: mx.array, values: mx.array, dk: int, dv: int, dtype: mx.Dtype, q: KVQuantization
) -> tuple[mx.array, mx.array]:
    """What packed ``keys`` and ``values`` hold, dequantized to heads of ``dk`` and ``dv``
    in ``dtype``."""
    if (
        keys.dtype == values.dtype == mx.uint16
        and keys.shape[-1] == q.width(dk, dtype)
        and values.shape[-1] == q.width(dv, dtype)
        and _use_kernel("dequantize", keys, values, dk, dv, dtype, q)
    ):
        outk, outv = _launch("dequantize", keys, values, dk, dv, dtype, q)
        return outk, outv
    return dequantize_packed(keys, dk, dtype, q), dequantize_packed(values, dv, dtype, q)


def dequantize_packed(packed: mx.array, dim: int, dtype: mx.Dtype, q: KVQuantization) -> mx.array:
    """What a packed array holds, dequantized to heads of ``dim`` in ``dtype``, with
    MLX's ops."""
    return mx.dequantize(*unpack(packed, dim, dtype, q), group_size=q.group_size, bits=q.bits)


def _quantize_with_ops(keys: mx.array, values: mx.array, q: KVQuantization) -> Step:
    tk = mx.quantize(keys, group_size=q.group_size, bits=q.bits)
    tv = mx.quantize(values, group_size=q.group_size, bits=q.bits)
    return (
        pack(tk),
        pack(tv),
        mx.dequantize(*tk, group_size=q.group_size, bits=q.bits),
        mx.dequantize(*tv, group_size=q.group_size, bits=q.bits),
    )


def _use_kernel(
    kind: str,
    keys: mx.array,
    values: mx.array,
    dk: int,
    dv: int,
    dtype: mx.Dtype,
    q: KVQuantization,
) -> bool:
    """Whether ``kind``'s kernel takes these arrays: on a CUDA GPU, ``[batch, heads,
    tokens, _]`` arrays of as many rows, whole groups, a grid CUDA can launch, and the
    kernel checked against MLX's ops for this combination."""
    if not (
        kernel_available()
        and dtype in _FLOATS
        and keys.ndim == values.ndim == 4
        and keys.shape[:-1] == values.shape[:-1]
        and dk % q.group_size == 0
        and dv % q.group_size == 0
        and 0 < _threads(kind, keys.size // keys.shape[-1], dk, dv, q) < 2**31
    ):
        return False
    return _agreed(kind, dk, dv, dtype, q)


def compile_kernels(dk: int, dv: int, dtype: mx.Dtype, q: KVQuantization) -> None:
    """Compile and check both kernels for heads of ``dk`` and ``dv`` in ``dtype`` (on a
    CUDA GPU: MLX compiles a custom kernel at its first launch in each process, 1-2 s on
    an H100), so that no step waits for it."""
    if kernel_available() and dtype in _FLOATS and dk % q.group_size == dv % q.group_size == 0:
        for kind in _SOURCES:
            _agreed(kind, dk, dv, dtype, q)


def _agreed(kind: str, dk: int, dv: int, dtype: mx.Dtype, q: KVQuantization) -> bool:
    key = (kind, dtype, q.bits, q.group_size, dk, dv)
    agrees = _agrees.get(key)
    if agrees is None:
        try:
            agrees = _check(kind, dk, dv, dtype, q)
        except Exception:  # not compiled or launched here (NVRTC, CUDA, MLX's API): an
            agrees = False  # optional fast path falls back to MLX's ops, never fails a step
        _agrees[key] = agrees
    return agrees


def _check(kind: str, dk: int, dv: int, dtype: mx.Dtype, q: KVQuantization) -> bool:
    """Whether ``kind``'s kernel gives MLX's ops' bits on a small input of mixed signs,
    zeros and a constant row: once per combination, so that an MLX release whose
    arithmetic moved makes the caches fall back to MLX's ops instead of drifting from
    them (deterministic values: the random state is left alone)."""

    def rows(dim: int, scale: float) -> mx.array:
        x = mx.sin(mx.arange(2 * 3 * 5 * dim, dtype=mx.float32) * scale) * 4
        x = x.reshape(2, 3, 5, dim)
        x[:, :, 1, :] = 0
        x[:, :, 2, :] = -1.5
        return x.astype(dtype)

    keys, values = rows(dk, 0.37), rows(dv, 1.13)
    want = list(_quantize_with_ops(keys, values, q))
    if kind == "quantize":
        got = _launch(kind, keys, values, dk, dv, dtype, q)
    else:
        got = _launch(kind, want[0], want[1], dk, dv, dtype, q)
        want = want[2:]
    return all(
        a.shape == b.shape and mx.array_equal(_bits(a), _bits(b)).item()
        for a, b in zip(got, want, strict=True)
    )


def _bits(a: mx.array) -> mx.array:
    return a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16)


def _threads(kind: str, rows: int, dk: int, dv: int, q: KVQuantization) -> int:
    """Threads of a launch: one per group (quantize) or 32-bit word of data
    (dequantize) of the keys' rows, then of the values'."""
    if kind == "quantize":
        return rows * (dk // q.group_size + dv // q.group_size)
    return rows * (dk + dv) * q.bits // 32


def _launch(
    kind: str,
    keys: mx.array,
    values: mx.array,
    dk: int,
    dv: int,
    dtype: mx.Dtype,
    q: KVQuantization,
) -> list[mx.array]:
    """One launch of ``kind``'s kernel on keys and values."""
    lead = keys.shape[:-1]
    if kind == "quantize":
        shapes = [
            (*lead, q.width(dk, dtype)),
            (*lead, q.width(dv, dtype)),
            (*lead, dk),
            (*lead, dv),
        ]
        dtypes = [mx.uint16, mx.uint16, dtype, dtype]
    else:
        shapes, dtypes = [(*lead, dk), (*lead, dv)], [dtype, dtype]
    outputs: list[mx.array] = _get_kernel(kind)(
        inputs=[keys, values],
        template=[("T", dtype), ("BITS", q.bits), ("GS", q.group_size), ("DK", dk), ("DV", dv)],
        grid=(_threads(kind, keys.size // keys.shape[-1], dk, dv, q), 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    return outputs


# A packed row (a token's head) is [data as uint32 | scales | biases], as
# _quantized.pack lays it out; group j of a row is its GS values from j * GS.
_HEADER = """
template <typename T, int BITS, int GS>
struct Packed {
  static constexpr int per_word = 32 / BITS;
  int groups, width, j;
  size_t row;
  __device__ Packed(int dim, size_t group)
      : groups(dim / GS),
        width(dim * BITS / 16 + 2 * (dim / GS) * int(sizeof(T) / 2)),
        j(group % (dim / GS)),
        row(group / (dim / GS)) {}
  // Where the group's data words and the row's scales start, in uint16 values.
  __device__ size_t data() const { return row * width + j * (GS * BITS / 16); }
  __device__ size_t scales(int dim) const { return row * width + dim * BITS / 16; }
};

// affine_quantize's arithmetic, and affine_dequantize's for the value handed out.
template <typename T, int BITS, int GS>
__device__ void quantize_group(
    const T* x, uint16_t* packed, T* out, int dim, size_t group) {
  constexpr float eps = 1e-7;
  constexpr float n_bins = (1 << BITS) - 1;
  const Packed<T, BITS, GS> at(dim, group);
  x += at.row * dim + at.j * GS;
  out += at.row * dim + at.j * GS;

  float w[GS];
  float w_min = mlx::core::cu::Limits<float>::max();
  float w_max = 0;
  for (int i = 0; i < GS; i++) {
    float val = x[i];
    w[i] = val;
    w_min = min(w_min, val);
    w_max = max(w_max, val);
  }
  float scale = max((w_max - w_min) / n_bins, eps);
  bool side = abs(w_min) > abs(w_max);
  scale = side ? scale : -scale;
  float edge = side ? w_min : w_max;
  float q0 = round(edge / scale);
  bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  float bias = at_zero ? 0 : edge;

  const T scale_t = static_cast<T>(scale);
  const T bias_t = static_cast<T>(bias);
  T* scales = reinterpret_cast<T*>(packed + at.scales(dim));
  scales[at.j] = scale_t;
  scales[at.groups + at.j] = bias_t;

  uint32_t* words = reinterpret_cast<uint32_t*>(packed + at.data());
  for (int wi = 0; wi < GS / at.per_word; wi++) {
    uint32_t word = 0;
    for (int b = 0; b < at.per_word; b++) {
      const int i = wi * at.per_word + b;
      uint8_t val = min(round((w[i] - bias) / scale), n_bins);
      word |= static_cast<uint32_t>(val) << (BITS * b);
      out[i] = scale_t * static_cast<T>(val) + bias_t;
    }
    words[wi] = word;
  }
}

// affine_dequantize's arithmetic, a thread per 32-bit word of data (MLX's takes a thread
// per byte), so that neighbouring threads read and write neighbouring memory.
template <typename T, int BITS, int GS>
__device__ void dequantize_word(
    const uint16_t* packed, T* out, int dim, size_t word) {
  constexpr int per_word = 32 / BITS;
  const int words = dim * BITS / 32;
  const int groups = dim / GS;
  const int width = dim * BITS / 16 + 2 * groups * int(sizeof(T) / 2);
  const size_t row = word / words;
  const int w = word % words;
  const int j = w * per_word / GS;
  const uint16_t* base = packed + row * width;
  const T* scales = reinterpret_cast<const T*>(base + dim * BITS / 16);
  const T scale = scales[j];
  const T bias = scales[groups + j];
  const uint32_t data = reinterpret_cast<const uint32_t*>(base)[w];
  out += row * dim + w * per_word;
  for (int b = 0; b < per_word; b++) {
    const uint8_t val = (data >> (BITS * b)) & ((1u << BITS) - 1);
    out[b] = scale * static_cast<T>(val) + bias;
  }
}
"""

# The first threads take the keys (a group or a word each), the next ones the values.
_SOURCES = {
    "quantize": (
        ["k", "v"],
        ["pk", "pv", "ko", "vo"],
        """
    const size_t rows = size_t(k_shape[0]) * k_shape[1] * k_shape[2];
    const size_t nk = rows * (DK / GS);
    const size_t g = cg::this_grid().thread_rank();
    if (g < nk) {
      quantize_group<T, BITS, GS>(k, pk, ko, DK, g);
    } else if (g < nk + rows * (DV / GS)) {
      quantize_group<T, BITS, GS>(v, pv, vo, DV, g - nk);
    }
""",
    ),
    "dequantize": (
        ["pk", "pv"],
        ["ko", "vo"],
        """
    const size_t rows = size_t(pk_shape[0]) * pk_shape[1] * pk_shape[2];
    const size_t nk = rows * (DK * BITS / 32);
    const size_t g = cg::this_grid().thread_rank();
    if (g < nk) {
      dequantize_word<T, BITS, GS>(pk, ko, DK, g);
    } else if (g < nk + rows * (DV * BITS / 32)) {
      dequantize_word<T, BITS, GS>(pv, vo, DV, g - nk);
    }
""",
    ),
}


def _get_kernel(kind: str) -> Any:
    kernel = _kernels.get(kind)
    if kernel is None:
        inputs, outputs, source = _SOURCES[kind]
        kernel = _kernels[kind] = mx.fast.cuda_kernel(
            name=f"mlx_actors_{kind}_kv",
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=_HEADER,
        )
    return kernel
