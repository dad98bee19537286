"""A batch's decode attention on a CUDA GPU: each row attends from its own first
position, with no padding mask.

A batch cache holds its rows left-padded to the longest, and mlx-lm's ``BatchKVCache``
hands attention a mask that hides the padding. MLX's fused attention kernels on CUDA take
no array mask, so every decoding step of a batch runs MLX's unfused attention (a matmul,
the mask, a softmax, a matmul, over every padded position): several times the time of
its fused vector kernel on the same tokens. The kernel here is that vector kernel
(``kernel_sdpav_1pass`` and ``kernel_sdpav_2pass_*`` in
``mlx/backend/cuda/scaled_dot_product_attention.cu``, MLX 0.32) with each row's keys
read from its first real position to its last: a row's output is bit for bit what
MLX's ``scaled_dot_product_attention`` gives that row alone, unpadded (as mlx-lm's
single-stream generation computes it), including the choice of one pass (rows of at most
1,024 tokens) or two. Two launches per layer: the first pass of the long rows, then
their second pass and the short rows' single pass.

Each combination of dtype, head size and scale is checked once against MLX's own
attention on each row alone (:func:`attend_with_ops`); where the bits differ (an MLX
release whose kernel moved) or it cannot be compiled, callers use MLX's masked attention.
No library does this for MLX: the source is MLX's two kernels, about 200 lines of CUDA,
with each row's span added.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._gather import kernel_available  # a CUDA GPU: where MLX runs custom kernels
from ._keep import as_rows

#: Head sizes MLX's vector kernel takes.
HEAD_DIMS = (64, 96, 128)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_SPLITS = 32  # the first pass's blocks per row and head (MLX's ``blocks``)

_kernels: dict[tuple[str, float], Any] = {}
#: Whether the kernels gave MLX's bits, by dtype, head size and scale.
_agrees: dict[tuple[Any, ...], bool] = {}


def usable(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> bool:
    """Whether :func:`attend` takes these here (:func:`takes`, :func:`runs`)."""
    return takes(queries, keys, values) and runs(queries.dtype, int(queries.shape[-1]), scale)


def takes(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether these are what :func:`attend` takes: one query per row, as many rows of
    keys and values, heads MLX's vector kernel takes, grouped query heads."""
    dim = int(queries.shape[-1])
    return (
        queries.ndim == keys.ndim == values.ndim == 4
        and queries.shape[2] == 1
        and queries.shape[0] == keys.shape[0] == values.shape[0]
        and queries.dtype == keys.dtype == values.dtype
        and queries.dtype in _FLOATS
        and dim in HEAD_DIMS
        and keys.shape[-1] == values.shape[-1] == dim
        and queries.shape[1] % keys.shape[1] == 0
    )


def runs(dtype: mx.Dtype, dim: int, scale: float) -> bool:
    """Whether the kernel runs here for this combination: a CUDA GPU, and the kernel
    checked against MLX's attention (a scale that is a Python float)."""
    return isinstance(scale, float) and kernel_available() and _agreed(dtype, dim, scale)


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    starts: mx.array,
    lengths: mx.array,
    scale: float,
) -> mx.array:
    """Attention of ``queries`` (``[rows, heads, 1, dim]``) over ``keys`` and ``values``
    (``[rows, kv_heads, tokens, dim]``, last axis contiguous): row ``b`` over positions
    ``starts[b]`` to ``starts[b] + lengths[b]``."""
    rows, heads, _, dim = queries.shape
    dtype = queries.dtype
    starts, lengths = starts.astype(mx.int32), lengths.astype(mx.int32)
    template = [("T", dtype), ("D", dim)]
    partials, sums, maxs = _kernel("split", scale)(
        inputs=[queries, keys, values, starts, lengths],
        template=template,
        grid=(heads * 256, 1, rows * _SPLITS),
        threadgroup=(256, 1, 1),
        output_shapes=[(rows, heads, _SPLITS, dim), (rows, heads, _SPLITS), (rows, heads, _SPLITS)],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = _kernel("finish", scale)(
        inputs=[queries, keys, values, starts, lengths, partials, sums, maxs],
        template=template,
        grid=(heads * 1024, 1, rows),
        threadgroup=(1024, 1, 1),
        output_shapes=[(rows, heads, 1, dim)],
        output_dtypes=[dtype],
    )
    return out  # type: ignore[no-any-return]


def attend_with_ops(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    starts: mx.array,
    lengths: mx.array,
    scale: float,
) -> mx.array:
    """What :func:`attend` computes, with MLX's attention on each row alone (a launch per
    row: its definition, not a fast path)."""
    spans = zip(as_rows(starts), as_rows(lengths), strict=True)
    return mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(
                queries[b : b + 1],
                keys[b : b + 1, :, s : s + n],
                values[b : b + 1, :, s : s + n],
                scale=scale,
            )
            for b, (s, n) in enumerate(spans)
        ]
    )


def compile_kernel(dtype: mx.Dtype, dim: int, scale: float) -> None:
    """Compile and check the kernels for ``dtype``, heads of ``dim`` and ``scale`` (on a
    CUDA GPU; MLX compiles a custom kernel at its first launch in each process)."""
    if kernel_available() and dtype in _FLOATS and dim in HEAD_DIMS:
        _agreed(dtype, dim, scale)


def _agreed(dtype: mx.Dtype, dim: int, scale: float) -> bool:
    key = (dtype, dim, scale)
    agrees = _agrees.get(key)
    if agrees is None:
        try:
            agrees = _check(dtype, dim, scale)
        except Exception:  # not compiled or launched here (NVRTC, CUDA, MLX's API): an
            agrees = False  # optional fast path falls back to MLX's ops, never fails a step
        _agrees[key] = agrees
    return agrees


def _check(dtype: mx.Dtype, dim: int, scale: float) -> bool:
    """Whether each row's output has the bits of MLX's attention on that row alone: rows
    of one and two passes, padded, with grouped heads (deterministic values)."""
    lengths, tokens, heads, kv_heads = [1500, 700, 1, 1031], 1600, 4, 2
    n = len(lengths) * kv_heads * tokens * dim
    keys = (mx.sin(mx.arange(n, dtype=mx.float32) * 0.37) * 2).astype(dtype)
    values = (mx.cos(mx.arange(n, dtype=mx.float32) * 1.13) * 3).astype(dtype)
    keys = keys.reshape(len(lengths), kv_heads, tokens, dim)
    values = values.reshape(len(lengths), kv_heads, tokens, dim)
    nq = len(lengths) * heads * dim
    queries = (mx.sin(mx.arange(nq, dtype=mx.float32) * 0.71) * 2).astype(dtype)
    queries = queries.reshape(len(lengths), 1, heads, dim).transpose(0, 2, 1, 3)
    starts = mx.array([tokens - n - (b % 2) for b, n in enumerate(lengths)])
    got = attend(queries, keys, values, starts, mx.array(lengths), scale)
    want = attend_with_ops(queries, keys, values, starts, mx.array(lengths), scale)
    return bool(mx.array_equal(_bits(got), _bits(want)).item())


def _bits(a: mx.array) -> mx.array:
    return a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16)


def _kernel(kind: str, scale: float) -> Any:
    kernel = _kernels.get((kind, scale))
    if kernel is None:
        inputs = ["q", "k", "v", "starts", "lengths"]
        if kind == "split":
            outputs, source = ["partials", "sums", "maxs"], _SPLIT
        else:
            inputs += ["partials", "sums", "maxs"]
            outputs, source = ["out"], _FINISH
        name = f"mlx_actors_decode_{kind}_{scale.hex().replace('.', '_').replace('-', 'm')}"
        kernel = _kernels[(kind, scale)] = mx.fast.cuda_kernel(
            name=name.replace("+", "p"),
            input_names=inputs,
            output_names=outputs,
            source=_COMMON.replace("{scale}", scale.hex()) + source,
            header="#include <cooperative_groups/reduce.h>\n",
            ensure_row_contiguous=False,
        )
    return kernel


# Where a row's keys and values start, read through the arrays' strides; the scale as
# MLX's attention keeps it (a float). The two kernels below are MLX's, line for line
# (their loops repeat each other as MLX's do), with each row's span added.
_COMMON = """
    typedef float U;
    constexpr int BD = 32;
    constexpr int v_per_thread = D / BD;
    const float scale = (float)({scale});
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane_idx = warp.thread_rank();
    const int warp_idx = warp.meta_group_rank();
    const int heads = gridDim.x;
    const int head_idx = blockIdx.x;
    const int kv_head_idx = head_idx / (heads / k_shape[1]);
"""

# MLX's kernel_sdpav_2pass_1 (no causal mask, no sinks) over the long rows.
_SPLIT = """
    constexpr int BN = 8;
    constexpr int blocks = 32;
    const int batch_idx = blockIdx.z / blocks;
    const int block_idx = blockIdx.z % blocks;
    const int kL = lengths[batch_idx * lengths_strides[0]];
    if (kL <= 1024) {
        return;
    }
    const long start = starts[batch_idx * starts_strides[0]];
    const int kv_seq_idx = block_idx * BN + warp_idx;
    const int inner_k_stride = blocks * BN * int(k_strides[2]);
    const int inner_v_stride = blocks * BN * int(v_strides[2]);

    U qv[v_per_thread];
    U kv[v_per_thread];
    U o[v_per_thread];

    __shared__ U outputs[BN][BD + 1];
    __shared__ U max_scores[BN];
    __shared__ U sum_exp_scores[BN];

    const U scale_log2 = scale * 1.44269504089f;

    const T* Q = q + batch_idx * q_strides[0] + head_idx * q_strides[1];
    const T* K = k + batch_idx * k_strides[0] + kv_head_idx * k_strides[1]
        + (start + kv_seq_idx) * k_strides[2];
    const T* V = v + batch_idx * v_strides[0] + kv_head_idx * v_strides[1]
        + (start + kv_seq_idx) * v_strides[2];

    const int p_offset = (batch_idx * heads + head_idx) * blocks + block_idx;
    float* P = partials + p_offset * D;

    for (int i = 0; i < v_per_thread; i++) {
        qv[i] = scale_log2 * static_cast<U>(Q[v_per_thread * lane_idx + i]);
    }
    for (int i = 0; i < v_per_thread; i++) {
        o[i] = 0.f;
    }

    U max_score = Limits<U>::finite_min();
    U sum_exp_score = 0.f;

    for (int i = kv_seq_idx; i < kL; i += blocks * BN) {
        for (int j = 0; j < v_per_thread; j++) {
            kv[j] = K[v_per_thread * lane_idx + j];
        }
        U score = 0.f;
        for (int j = 0; j < v_per_thread; j++) {
            score += qv[j] * kv[j];
        }
        score = cg::reduce(warp, score, cg::plus<U>());
        U new_max = max(max_score, score);
        U factor = exp2f(max_score - new_max);
        U exp_score = exp2f(score - new_max);
        max_score = new_max;
        sum_exp_score = sum_exp_score * factor + exp_score;
        for (int j = 0; j < v_per_thread; j++) {
            o[j] = o[j] * factor + exp_score * static_cast<U>(V[v_per_thread * lane_idx + j]);
        }
        K += inner_k_stride;
        V += inner_v_stride;
    }

    if (lane_idx == 0) {
        max_scores[warp_idx] = max_score;
        sum_exp_scores[warp_idx] = sum_exp_score;
    }
    block.sync();

    max_score = (lane_idx < BN) ? max_scores[lane_idx] : -1e9;
    U new_max = cg::reduce(warp, max_score, cg::greater<U>());
    U factor = exp2f(max_score - new_max);
    sum_exp_score = (lane_idx < BN) ? sum_exp_scores[lane_idx] : 0.f;
    sum_exp_score = cg::reduce(warp, sum_exp_score * factor, cg::plus<U>());

    if (warp_idx == 0) {
        sums[p_offset] = sum_exp_score;
        maxs[p_offset] = new_max;
    }

    auto ff = exp2f(max_scores[warp_idx] - new_max);
    for (int i = 0; i < v_per_thread; i++) {
        outputs[warp_idx][lane_idx] = o[i] * ff;
        block.sync();
        if (warp_idx == 0) {
            U ot = outputs[0][lane_idx];
            for (int j = 1; j < BN; j++) {
                ot += outputs[j][lane_idx];
                warp.sync();
            }
            o[i] = ot;
        }
        block.sync();
    }

    if (warp_idx == 0) {
        for (int i = 0; i < v_per_thread; i++) {
            P[v_per_thread * lane_idx + i] = o[i];
        }
    }
"""

# The long rows: MLX's kernel_sdpav_2pass_2. The short rows: its kernel_sdpav_1pass.
_FINISH = """
    constexpr int BN = 32;
    constexpr int blocks = 32;
    const int batch_idx = blockIdx.z;
    const int kL = lengths[batch_idx * lengths_strides[0]];

    U o[v_per_thread];
    __shared__ U outputs[BN][BD + 1];
    __shared__ U max_scores[BN];
    __shared__ U sum_exp_scores[BN];
    T* O = out + (batch_idx * heads + head_idx) * D;

    if (kL > 1024) {
        const int p_offset = (batch_idx * heads + head_idx) * blocks;
        const float* P = partials + p_offset * D + warp_idx * D;
        const float* S = sums + p_offset;
        const float* M = maxs + p_offset;

        U max_score = M[lane_idx];
        U new_max = cg::reduce(warp, max_score, cg::greater<U>());
        U factor = exp2f(max_score - new_max);
        U sum_exp_score = cg::reduce(warp, S[lane_idx] * factor, cg::plus<U>());
        sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

        for (int i = 0; i < v_per_thread; i++) {
            o[i] = P[v_per_thread * lane_idx + i];
        }
        for (int i = 0; i < v_per_thread; i++) {
            outputs[lane_idx][warp_idx] = o[i];
            block.sync();
            U ot = outputs[warp_idx][lane_idx] * factor;
            o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
            block.sync();
        }
    } else {
        const long start = starts[batch_idx * starts_strides[0]];
        const int kv_seq_idx = warp_idx;
        const int inner_k_stride = BN * int(k_strides[2]);
        const int inner_v_stride = BN * int(v_strides[2]);
        U qv[v_per_thread];
        U kv[v_per_thread];
        const U scale_log2 = scale * 1.44269504088896340736;

        const T* Q = q + batch_idx * q_strides[0] + head_idx * q_strides[1];
        const T* K = k + batch_idx * k_strides[0] + kv_head_idx * k_strides[1]
            + (start + kv_seq_idx) * k_strides[2];
        const T* V = v + batch_idx * v_strides[0] + kv_head_idx * v_strides[1]
            + (start + kv_seq_idx) * v_strides[2];

        for (int i = 0; i < v_per_thread; i++) {
            qv[i] = scale_log2 * static_cast<U>(Q[v_per_thread * lane_idx + i]);
        }
        for (int i = 0; i < v_per_thread; i++) {
            o[i] = 0.f;
        }

        U max_score = Limits<U>::finite_min();
        U sum_exp_score = 0.f;

        for (int i = kv_seq_idx; i < kL; i += BN) {
            for (int j = 0; j < v_per_thread; j++) {
                kv[j] = K[v_per_thread * lane_idx + j];
            }
            U score = 0.f;
            for (int j = 0; j < v_per_thread; j++) {
                score += qv[j] * kv[j];
            }
            score = cg::reduce(warp, score, cg::plus<U>());
            U new_max = max(max_score, score);
            U factor = exp2f(max_score - new_max);
            U exp_score = exp2f(score - new_max);
            max_score = new_max;
            sum_exp_score = sum_exp_score * factor + exp_score;
            for (int j = 0; j < v_per_thread; j++) {
                o[j] = o[j] * factor + exp_score * static_cast<U>(V[v_per_thread * lane_idx + j]);
            }
            K += inner_k_stride;
            V += inner_v_stride;
        }

        if (lane_idx == 0) {
            max_scores[warp_idx] = max_score;
            sum_exp_scores[warp_idx] = sum_exp_score;
        }
        block.sync();

        max_score = max_scores[lane_idx];
        U new_max = cg::reduce(warp, max_score, cg::greater<U>());
        U factor = exp2f(max_score - new_max);
        sum_exp_score = cg::reduce(warp, sum_exp_scores[lane_idx] * factor, cg::plus<U>());
        sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

        for (int i = 0; i < v_per_thread; i++) {
            outputs[lane_idx][warp_idx] = o[i];
            block.sync();
            U ot = outputs[warp_idx][lane_idx] * factor;
            o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
            block.sync();
        }
    }

    if (lane_idx == 0) {
        for (int i = 0; i < v_per_thread; i++) {
            O[v_per_thread * warp_idx + i] = static_cast<T>(o[i]);
        }
    }
"""
