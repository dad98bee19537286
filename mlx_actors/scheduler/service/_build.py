"""The engine thread's parts put together, on that thread: the model's cache spec, the
custom kernels its caches use (compiled before the first turn), the prefix index, the
block pool, the host tier, the cache manager, the batch engine and the loop that drives
them (each given what it calls at construction)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx

from ..caches import _attention, _gather, _quantize_kernels
from ..caches._quantized import KVQuantization
from ..engine._engine import BlockPoolBatchEngine
from ..engine._solo import kept_for
from ..kv._pool import BlockPool
from ..kv._prefix import PrefixIndex
from ..kv._spec import LayerKind, ModelCacheSpec
from ..residency import _transfer
from ..residency._host import HostCaches
from ..residency._manager import CacheManager
from ._events import Evicted
from ._loop import EngineLoop, Outbox


@attrs.frozen(kw_only=True)
class EngineOptions:
    """The scheduler's settings for the parts it builds (see :class:`~._actor.Scheduler`)."""

    pool_blocks: int | None
    pool_bytes: int | None
    max_batch_size: int
    prefill_step_size: int
    admission_window: float
    share_prefixes: bool
    #: Bytes of host memory for evicted caches (``None``: half the pool's).
    host_bytes: int | None
    kv_quantization: KVQuantization | None
    #: Decoding rows read their histories from the pool's blocks.
    paged_batch: bool = False
    #: A batch's decode attention through the project's kernel (on a CUDA GPU).
    decode_kernel: bool = True
    #: Compile every custom CUDA kernel the caches may launch before the first turn.
    compile_kernels: bool = False
    #: How an idle cache is chosen to leave the pool (``EVICTION_POLICIES``).
    eviction: str = "next-use"


def build_loop(
    model: Any,
    tokenizer: Any,
    options: EngineOptions,
    *,
    persistent_store: bool,
    commands: queue.SimpleQueue[object],
    deliver: Callable[[Outbox], None],
    coming: Callable[[], int],
    log: Any,
) -> EngineLoop:
    """The engine thread's loop over a new pool for ``model``."""
    spec = ModelCacheSpec.from_model(model, quantization=options.kv_quantization)
    began = time.perf_counter()
    if options.compile_kernels:
        _compile_kernels(spec, model)
    kernels_ms = (time.perf_counter() - began) * 1000
    index = PrefixIndex(spec)  # told of every block the pool releases
    if options.pool_blocks is not None:
        total = options.pool_blocks * spec.max_units
        pool = BlockPool(spec, total_blocks=total, on_release=index.detach)
    else:
        budget = options.pool_bytes or 1 << 30
        pool = BlockPool.from_bytes(spec, budget, on_release=index.detach)
    host = options.host_bytes
    host_caches = HostCaches(pool.budget_bytes // 2 if host is None else host)
    memory = _transfer.host_memory()
    if memory is not None:  # what the host tier keeps, and caches on their way to disk
        memory.allow(host_caches.budget + pool.budget_bytes // 8)
    kept = kept_for(pool)
    outbox: Outbox = []
    caches = CacheManager(
        pool,
        index,
        kept,
        host_caches,
        log=log,
        on_evicted=lambda agent, image: outbox.append(Evicted(agent, image)),
        share_prefixes=options.share_prefixes,
        persistent_store=persistent_store,
        eviction=options.eviction,
    )
    engine = BlockPoolBatchEngine(
        model,
        tokenizer,
        pool,
        max_batch_size=options.max_batch_size,
        prefill_step_size=options.prefill_step_size,
        share_prefixes=options.share_prefixes,
        paged_batch=options.paged_batch,
        decode_kernel=options.decode_kernel,
        index=index,
        kept_caches=kept,
        make_room=caches.make_room,
    )
    if mx.default_device().type == mx.DeviceType.gpu:
        # A GPU prefills thousands of tokens in a step's time: paced from the cautious
        # start, a process's first turns would run in chunks of a few tokens each.
        engine.calibrate_pacing()
    log.info(
        "scheduler.started",
        layers=spec.num_layers,
        sliding_layers=spec.sliding_layers,
        block_bytes=spec.block_bytes,
        pool_bytes=pool.budget_bytes,
        max_batch_size=options.max_batch_size,
        kernels_ms=round(kernels_ms, 1),
        prefill_budget=engine.pacing.budget(),
        **_kv_fields(spec.quantization),
    )
    return EngineLoop(
        engine,
        caches,
        outbox,
        commands,
        deliver,
        log=log,
        admission_window=options.admission_window,
        coming=coming,
    )


def _compile_kernels(spec: ModelCacheSpec, model: Any) -> None:
    """Compile the custom kernels the caches of ``spec`` may launch (on a CUDA GPU;
    nothing elsewhere): MLX compiles each at its first launch in a process, which
    inside a step holds up every sequence for a second or two."""
    _attention.compile_kernels(model, spec)
    _transfer.compile_kernels()
    done = set()
    for layer in spec.layers:
        q = layer.quantization
        if (layer.dtype, layer.key_dim, layer.value_dim, q) in done:
            continue
        done.add((layer.dtype, layer.key_dim, layer.value_dim, q))
        _gather.compile_kernels(layer.stored_dtype, layer.stored_key_dim, layer.stored_value_dim)
        if q is not None:
            _quantize_kernels.compile_kernels(layer.key_dim, layer.value_dim, layer.dtype, q)


def max_text_chars(tokenizer: Any, spec: ModelCacheSpec, pool_units: int) -> int | None:
    """More characters than the most tokens one turn can hold, each as long as the
    vocabulary's longest token, can never fit (``None``: the vocabulary is unknown)."""
    try:
        longest = max(len(piece) for piece in tokenizer.get_vocab())
    except Exception:
        return None
    global_layers = spec.num_layers - spec.sliding_layers
    per_block = sum(
        spec.units(i) for i, layer in enumerate(spec.layers) if layer.kind is LayerKind.GLOBAL
    )
    tokens = pool_units // max(per_block, 1) * spec.block_size
    if spec.context_length is not None and global_layers:
        tokens = min(tokens, spec.context_length)
    elif spec.context_length is not None:
        tokens = spec.context_length
    return max(tokens, 1) * max(longest, 1)


def _kv_fields(q: KVQuantization | None) -> dict[str, Any]:
    """What the start log says of a quantized cache: its bits, and whether global layers
    attend through mlx-lm's quantized attention or over dequantized keys and values
    (where that cannot run: MLX's CUDA backend)."""
    if q is None:
        return {}
    return {"kv_bits": q.bits, "kv_attention": q.attention}
