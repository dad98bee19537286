"""A runtime's engine options checked where they are given: a typed error for each bad
value, and the scheduler's options (with the default pool) from the good ones."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidRequestError
from ..scheduler import EVICTION_POLICIES, KVQuantization


def default_pool_bytes() -> int:
    """A quarter of physical memory: room for the model and the batch's working caches."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def scheduler_options(
    *,
    max_batch_size: int,
    pool_bytes: int | None,
    pool_blocks: int | None,
    host_bytes: int | None,
    prefill_step_size: int,
    admission_window: float,
    mailbox_size: int,
    share_prefixes: bool,
    kv_quantization: KVQuantization | None,
    paged_batch: bool,
    decode_kernel: bool,
    compile_kernels: bool,
    eviction: str,
) -> dict[str, Any]:
    """The :class:`~..scheduler.Scheduler`'s keyword options (``mailbox_size`` is only
    checked: it is the agents').

    Raises:
        InvalidRequestError: a value out of its range, or of the wrong type.
    """
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("prefill_step_size", prefill_step_size),
        ("mailbox_size", mailbox_size),
        ("pool_bytes", pool_bytes),
        ("pool_blocks", pool_blocks),
    ):
        if value is None and name.startswith("pool"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
    if (
        isinstance(admission_window, bool)
        or not isinstance(admission_window, (int, float))
        or not 0 <= admission_window <= 1
    ):
        raise InvalidRequestError(
            f"admission_window must be seconds in [0, 1], got {admission_window!r}"
        )
    if pool_bytes is not None and pool_blocks is not None:
        raise InvalidRequestError("give pool_bytes or pool_blocks, not both")
    if host_bytes is not None and (
        isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0
    ):
        raise InvalidRequestError(f"host_bytes must be an int >= 0, got {host_bytes!r}")
    if eviction not in EVICTION_POLICIES:
        raise InvalidRequestError(
            f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}"
        )
    if pool_blocks is None and pool_bytes is None:
        pool_bytes = default_pool_bytes()
    return dict(
        pool_blocks=pool_blocks,
        pool_bytes=pool_bytes,
        host_bytes=host_bytes,
        max_batch_size=max_batch_size,
        prefill_step_size=prefill_step_size,
        admission_window=admission_window,
        share_prefixes=bool(share_prefixes),
        kv_quantization=kv_quantization,
        paged_batch=bool(paged_batch),
        decode_kernel=bool(decode_kernel),
        compile_kernels=bool(compile_kernels),
        eviction=eviction,
    )
