"""Files of a runtime's state: atomic writes, JSON, and safetensors without pickle or MLX."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptStateError

#: safetensors dtype codes of the cache dtypes, and numpy types of the same width.
DTYPE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_BITS = {"F16": np.uint16, "BF16": np.uint16, "F32": np.uint32}
FORMAT = 1


# -- atomic files ------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that it is either its old content or all of ``data``: a temporary
    file in the same directory, fsync, rename, fsync of the directory."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


#: Checksums of large files are taken over pieces of this size, on several threads.
PIECE = 4 << 20
_hashing = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), "mlx-actors-sha256")


def _sha256_digest(piece: memoryview) -> bytes:
    return hashlib.sha256(piece).digest()


def piecewise_sha256(data: bytes) -> str:
    """The sha256 of the sha256 digests of ``data``'s 4 MiB pieces: as strong a check as
    one sha256 over the data, but computed on several cores (hashlib releases the GIL)."""
    view = memoryview(data)
    pieces = [view[i : i + PIECE] for i in range(0, len(view), PIECE)] or [view]
    if len(pieces) == 1:
        digests = [_sha256_digest(pieces[0])]
    else:
        digests = list(_hashing.map(_sha256_digest, pieces))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def make_dir(path: Path) -> None:
    """Create ``path`` and its missing parents, each entry made durable (fsync of the
    directory that lists it)."""
    if path.is_dir():
        return
    make_dir(path.parent)
    path.mkdir(exist_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=1, sort_keys=True).encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStateError(f"{path} is not valid JSON (corrupt or truncated): {exc}") from exc


# -- safetensors ---------------------------------------------------------------------------


def safetensors_bytes(
    tensors: Mapping[str, np.ndarray], dtype: str, metadata: Mapping[str, str]
) -> Iterator[bytes]:
    """The pieces of a safetensors file holding ``tensors`` (the bits of ``dtype`` values,
    as unsigned integers of the same width)."""
    code = DTYPE_CODES[dtype]
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, a in tensors.items():
        header[name] = {
            "dtype": code,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for a in tensors.values():
        yield np.ascontiguousarray(a).tobytes()


def read_safetensors(path: Path, sha256: str | None = None) -> tuple[dict[str, np.ndarray], str]:
    """Tensors of a safetensors file (as unsigned bits) and their dtype; checks the file's
    checksum and that every tensor lies inside it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptStateError(f"{path} is missing") from exc
    if sha256 is not None and piecewise_sha256(data) != sha256:
        raise CorruptStateError(f"{path} does not match its checksum: corrupt or truncated")
    try:
        (size,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + size])
        body = memoryview(data)[8 + size :]
        header.pop("__metadata__", None)
        tensors, codes = {}, set()
        for name, info in header.items():
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            bits = _BITS[code]
            if (
                not 0 <= begin <= end <= len(body)
                or end - begin != math.prod(shape) * np.dtype(bits).itemsize
            ):
                raise ValueError(f"tensor {name} lies outside the file")
            tensors[name] = np.frombuffer(body[begin:end], dtype=bits).reshape(shape)
            codes.add(code)
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise CorruptStateError(f"{path} is not a valid safetensors file: {exc}") from exc
    names = {v: k for k, v in DTYPE_CODES.items()}
    if len(codes) > 1:
        raise CorruptStateError(f"{path} mixes dtypes {sorted(codes)}")
    return tensors, names[codes.pop()] if codes else "float16"
