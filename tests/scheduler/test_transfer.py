"""Cache blocks copied to host memory and back (``scheduler/residency/_transfer.py``): bit for bit.

On this machine the copies are MLX's own (``mx.array``, ``np.array``); on MLX's CUDA
backend the same test runs the CUDA driver's copies, which must give the same bits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_actors.scheduler.residency import _transfer, to_device, to_host


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
