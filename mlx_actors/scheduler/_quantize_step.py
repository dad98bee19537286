"""A decoding step's new keys and values, quantized, packed as blocks keep them, and
dequantized: on a CUDA GPU one kernel launch for both, elsewhere MLX's own ops.

The caches of :mod:`._dequantized` do this to every token they take. With MLX's ops it
is five kernels per array (quantize, the copy that packs the triple, dequantize, and the
two writes into the cache), each small, so that on a GPU a decoding step of a quantized
batch is launches more than arithmetic. The kernel here does the first three for keys
and values together, bit for bit as MLX's CUDA backend does them (its
``affine_quantize`` and ``affine_dequantize``, one thread per group instead of a warp:
the minimum and maximum of a group do not depend on the order they are taken in).
``benchmarks/quantize_step.py`` checks it against MLX's ops on the GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._quantized import KVQuantization, pack

#: A step's keys and values packed, then dequantized.
Step = tuple[mx.array, mx.array, mx.array, mx.array]

_kernel: Any = None


def quantize_step(keys: mx.array, values: mx.array, q: KVQuantization) -> Step:
    """``keys`` and values quantized as ``mx.quantize`` does, packed (:func:`pack`), and
    what they hold, dequantized."""
    if kernel_available() and _fits(keys, values):
        return _launch(keys, values, q)
    tk = mx.quantize(keys, group_size=q.group_size, bits=q.bits)
    tv = mx.quantize(values, group_size=q.group_size, bits=q.bits)
    return (
        pack(tk),
        pack(tv),
        mx.dequantize(*tk, group_size=q.group_size, bits=q.bits),
        mx.dequantize(*tv, group_size=q.group_size, bits=q.bits),
    )


def kernel_available() -> bool:
    """Whether the kernel can run here: MLX's default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _fits(keys: mx.array, values: mx.array) -> bool:
    return (
        keys.dtype == values.dtype
        and keys.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and keys.shape[:-1] == values.shape[:-1]
    )


def _launch(keys: mx.array, values: mx.array, q: KVQuantization) -> Step:
    dk, dv, dtype = int(keys.shape[-1]), int(values.shape[-1]), keys.dtype
    groups = (keys.size // dk) * (dk // q.group_size + dv // q.group_size)
    pk, pv, outk, outv = _get_kernel()(
        inputs=[keys, values],
        template=[("T", dtype), ("BITS", q.bits), ("GS", q.group_size), ("DK", dk), ("DV", dv)],
        grid=(groups, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[
            (*keys.shape[:-1], q.width(dk, dtype)),
            (*values.shape[:-1], q.width(dv, dtype)),
            keys.shape,
            values.shape,
        ],
        output_dtypes=[mx.uint16, mx.uint16, dtype, dtype],
    )
    return pk, pv, outk, outv


# One thread per group of GS values along a head: the arithmetic of MLX's CUDA
# affine_quantize (mlx/backend/cuda/quantized/affine_quantize.cu, 0.32) for the scale,
# the bias and each value, and of its affine_dequantize for the value handed out. A
# packed row is [data as uint32 | scales | biases], as _quantized.pack lays it out.
_HEADER = """
template <typename T, int BITS, int GS>
__device__ void quantize_group(
    const T* x, uint16_t* packed, T* out, int dim, size_t group) {
  constexpr float eps = 1e-7;
  constexpr float n_bins = (1 << BITS) - 1;
  constexpr int per_word = 32 / BITS;
  const int groups = dim / GS;
  const int width = dim * BITS / 16 + 2 * groups * int(sizeof(T) / 2);
  const size_t row = group / groups;
  const int j = group % groups;
  x += row * dim + j * GS;
  out += row * dim + j * GS;
  uint16_t* base = packed + row * width;

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
  T* scales = reinterpret_cast<T*>(base + dim * BITS / 16);
  scales[j] = scale_t;
  scales[groups + j] = bias_t;

  uint32_t* words = reinterpret_cast<uint32_t*>(base) + j * (GS / per_word);
  for (int wi = 0; wi < GS / per_word; wi++) {
    uint32_t word = 0;
    for (int b = 0; b < per_word; b++) {
      const int i = wi * per_word + b;
      uint8_t val = min(round((w[i] - bias) / scale), n_bins);
      word |= static_cast<uint32_t>(val) << (BITS * b);
      out[i] = scale_t * static_cast<T>(val) + bias_t;
    }
    words[wi] = word;
  }
}
"""

_SOURCE = """
    const size_t rows = size_t(k_shape[0]) * k_shape[1] * k_shape[2];
    const size_t nk = rows * (DK / GS);
    const size_t g = cg::this_grid().thread_rank();
    if (g < nk) {
      quantize_group<T, BITS, GS>(k, pk, ko, DK, g);
    } else if (g < nk + rows * (DV / GS)) {
      quantize_group<T, BITS, GS>(v, pv, vo, DV, g - nk);
    }
"""


def _get_kernel() -> Any:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlx_actors_quantize_step",
            input_names=["k", "v"],
            output_names=["pk", "pv", "ko", "vo"],
            source=_SOURCE,
            header=_HEADER,
        )
    return _kernel
