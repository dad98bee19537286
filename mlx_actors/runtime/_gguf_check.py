"""The structural check of a GGUF file that runs before ``mx.load`` sees it.

``mx.load`` (mlx 0.32's gguflib) trusts every count, length, type and offset in a GGUF
file, so a corrupt or truncated one can kill the process (SIGSEGV, SIGFPE, abort) instead of
raising. This module owns the check that comes first: it walks the header, the metadata
key/value table and the tensor-info table with bounded reads (every length and count is
checked against the bytes left before anything is read or looped over; the tensor data is
never read, so the time goes with the tables, not the file: 30 ms for SmolLM2's), then that every
tensor's data, sized from its ggml type and dimensions, is aligned, lies inside the file and
overlaps no other. What does not add up raises ``ModelIntegrityError`` naming the file.

A well-formed file that ``mx.load`` cannot read (a ggml type it does not convert, nested
metadata arrays) raises ``UnsupportedModelError`` instead.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ..errors import ModelIntegrityError, UnsupportedModelError

__all__ = ["check_gguf"]

MAGIC = b"GGUF"
#: GGUF versions with 64-bit counts and lengths (version 1 had 32-bit ones).
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: ggml's GGML_MAX_DIMS (gguflib aborts past 8).
MAX_DIMS = 4
#: The GGUF spec's limits on the length of a metadata key and of a tensor name.
MAX_KEY_BYTES = 2**16 - 1
MAX_NAME_BYTES = 64
#: llama.cpp's bound on a dimension and on a tensor's element count (int64).
MAX_ELEMENTS = 2**63 - 1

# metadata value types
_UINT32, _BOOL, _STRING, _ARRAY = 4, 7, 8, 9
#: bytes of each fixed-size metadata value type
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, _UINT32: 4, 5: 4, 6: 4, _BOOL: 1, 10: 8, 11: 8, 12: 8}
_VALUE_TYPES = (*_VALUE_SIZES, _STRING, _ARRAY)


class GGMLType(NamedTuple):
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block


#: ggml's tensor types (ggml.h, type_traits in ggml.c); 4, 5, 31-33 and 36-38 were removed.
GGML_TYPES = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 36),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
    40: GGMLType("NVFP4", 64, 36),
    41: GGMLType("Q1_0", 128, 18),
}
#: The types mx.load (mlx 0.32) reads: it fails on the others, or drops their tensors.
MLX_TYPES = frozenset({0, 1, 2, 3, 8, 10, 12, 14, 24, 25, 26, 30})

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: How much of the tables one read brings in.
_WINDOW = 1 << 20
#: The fewest bytes a metadata entry (empty key, type, 1-byte value) and a tensor info
#: (empty name, no dimensions, type, offset) take.
_MIN_ENTRY_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def check_gguf(path: Path) -> None:
    """Check that ``path`` is a GGUF file ``mx.load`` can read without crashing.

    Raises:
        ModelIntegrityError: it is not a GGUF file, or its tables or tensor data do not
            add up (counts or lengths past the end of the file, unknown types, tensors
            past the end, misaligned or overlapping...).
        UnsupportedModelError: it is well formed but holds what ``mx.load`` cannot read.
        OSError: it cannot be read.
    """
    with path.open("rb") as file:
        reader = _Reader(file, path)
        tensor_count, kv_count = _header(reader)
        alignment = _metadata(reader, kv_count)
        tensors = _tensor_infos(reader, tensor_count)
        data_start = _aligned(reader.pos, alignment)
    _check_tensor_data(path, tensors, data_start, reader.size, alignment)


def _corrupt(path: Path, detail: str) -> ModelIntegrityError:
    return ModelIntegrityError(f"{path} is not a valid GGUF file: {detail}")


class _Reader:
    """Little-endian reads from the start of a file, each checked against the file size
    before it happens; only the window being read is held in memory."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file = file
        self.path = path
        self.size = file.seek(0, 2)
        self.pos = 0
        self._window = b""
        self._window_start = 0

    def past_end(self, n: int, what: str) -> ModelIntegrityError:
        return _corrupt(
            self.path,
            f"{what} ({n} bytes at offset {self.pos}) runs past the end of the file "
            f"({self.size} bytes): it is truncated or corrupt",
        )

    def require(self, n: int, what: str) -> None:
        """Fail unless ``n`` more bytes follow the current position."""
        if n > self.size - self.pos:
            raise self.past_end(n, what)

    def _view(self, n: int, what: str) -> int:
        """Where the next ``n`` bytes start in the window, reading a new one if needed."""
        self.require(n, what)
        at = self.pos - self._window_start
        if at + n > len(self._window):
            self.file.seek(self.pos)
            self._window = self.file.read(max(n, _WINDOW))
            self._window_start, at = self.pos, 0
            if len(self._window) < n:  # the file shrank under us
                raise self.past_end(n, what)
        return at

    def read(self, n: int, what: str) -> bytes:
        at = self._view(n, what)
        self.pos += n
        return self._window[at : at + n]

    def u32(self, what: str) -> int:
        at = self._view(4, what)  # first: it may move the window
        value: int = _U32.unpack_from(self._window, at)[0]
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        at = self._view(8, what)
        value: int = _U64.unpack_from(self._window, at)[0]
        self.pos += 8
        return value

    def skip(self, n: int, what: str) -> None:
        self.require(n, what)
        self.pos += n

    def text(self, what: str, limit: int) -> str:
        """A GGUF string of at most ``limit`` bytes of UTF-8."""
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise _corrupt(
                self.path, f"{what} at offset {self.pos - 8} is {n} bytes long (at most {limit})"
            )
        raw = self.read(n, what)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise _corrupt(self.path, f"{what} {raw!r} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` GGUF strings without reading their bytes."""
        # the hot loop of a big vocabulary: on locals, back to self when the window moves
        pos, size, unpack = self.pos, self.size, _U64.unpack_from
        window, start = self._window, self._window_start
        for _ in range(count):
            if pos + 8 - start > len(window):
                self.pos = pos
                self._view(8, what)
                window, start = self._window, self._window_start
            n: int = unpack(window, pos - start)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.past_end(n, what)
            pos += n
        self.pos = pos


def _header(reader: _Reader) -> tuple[int, int]:
    """Magic and version; the tensor and metadata counts."""
    magic = reader.read(4, "the magic")
    if magic != MAGIC:
        raise _corrupt(reader.path, f"it starts with {magic!r}, not {MAGIC!r}")
    reader.require(20, "the rest of the 24-byte header")
    version = reader.u32("the version")
    if version not in VERSIONS:
        byte_swapped = version & 0xFFFF == 0 and version != 0
        hint = " (a big-endian file?)" if byte_swapped else ""
        raise _corrupt(reader.path, f"unsupported GGUF version {version}{hint}; 2 and 3 are")
    tensor_count = reader.u64("the tensor count")
    kv_count = reader.u64("the metadata count")
    _check_count(reader, kv_count, _MIN_ENTRY_BYTES, "metadata entries")
    _check_count(reader, tensor_count, _MIN_TENSOR_INFO_BYTES, "tensors")
    return tensor_count, kv_count


def _check_count(reader: _Reader, count: int, min_bytes: int, what: str) -> None:
    """Fail if ``count`` items of at least ``min_bytes`` each cannot fit in what is left."""
    left = reader.size - reader.pos
    if count > left // min_bytes:
        raise _corrupt(
            reader.path,
            f"it claims {count} {what} at offset {reader.pos}, more than the {left} bytes "
            f"left can hold: it is truncated or corrupt",
        )


def _metadata(reader: _Reader, count: int) -> int:
    """Walk the metadata entries; the data alignment they set."""
    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for index in range(count):
        key = reader.text(f"metadata key {index}", MAX_KEY_BYTES)
        if key in keys:
            raise _corrupt(reader.path, f"metadata key {key!r} appears twice")
        keys.add(key)
        kind = reader.u32(f"the type of metadata {key!r}")
        if key == "general.alignment":
            alignment = _alignment(reader, kind)
        else:
            _skip_value(reader, kind, key)
    return alignment


def _alignment(reader: _Reader, kind: int) -> int:
    if kind != _UINT32:
        raise _corrupt(reader.path, f"general.alignment has value type {kind}, not uint32")
    alignment = reader.u32("general.alignment")
    if alignment == 0 or alignment & (alignment - 1):
        raise _corrupt(reader.path, f"general.alignment {alignment} is not a power of two")
    return alignment


def _skip_value(reader: _Reader, kind: int, key: str) -> None:
    """Step over one metadata value of type ``kind``."""
    what = f"the value of metadata {key!r}"
    if kind in _VALUE_SIZES:
        reader.skip(_VALUE_SIZES[kind], what)
    elif kind == _STRING:
        reader.skip_strings(1, what)
    elif kind == _ARRAY:
        _skip_array(reader, key)
    else:
        raise _corrupt(reader.path, f"metadata {key!r} has unknown value type {kind}")


def _skip_array(reader: _Reader, key: str) -> None:
    kind = reader.u32(f"the element type of metadata array {key!r}")
    length = reader.u64(f"the length of metadata array {key!r}")
    if kind == _ARRAY:
        raise UnsupportedModelError(
            f"{reader.path}: metadata {key!r} is an array of arrays, which mx.load cannot read"
        )
    if kind not in _VALUE_TYPES:
        raise _corrupt(reader.path, f"metadata array {key!r} has unknown element type {kind}")
    element_bytes = _VALUE_SIZES.get(kind, 8)  # a string takes at least its 8-byte length
    _check_count(reader, length, element_bytes, f"elements in metadata array {key!r}")
    if kind == _STRING:
        reader.skip_strings(length, f"a string in metadata array {key!r}")
    else:
        reader.skip(length * element_bytes, f"metadata array {key!r}")


class _TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order: innermost first
    ggml_type: GGMLType
    offset: int  # from the start of the data section

    @property
    def nbytes(self) -> int:
        elements = 1
        for n in self.dims:
            elements *= n
        return elements // self.ggml_type.block_size * self.ggml_type.type_size


def _tensor_infos(reader: _Reader, count: int) -> list[_TensorInfo]:
    tensors: list[_TensorInfo] = []
    names: set[str] = set()
    for index in range(count):
        tensor = _tensor_info(reader, index)
        if tensor.name in names:
            raise _corrupt(reader.path, f"tensor {tensor.name!r} appears twice")
        names.add(tensor.name)
        tensors.append(tensor)
    return tensors


def _tensor_info(reader: _Reader, index: int) -> _TensorInfo:
    name = reader.text(f"the name of tensor {index}", MAX_NAME_BYTES)
    what = f"the info of tensor {name!r}"
    n_dims = reader.u32(what)
    if n_dims > MAX_DIMS:
        raise _corrupt(reader.path, f"tensor {name!r} has {n_dims} dimensions (at most 4)")
    dims = tuple(reader.u64(what) for _ in range(n_dims))
    code = reader.u32(what)
    offset = reader.u64(what)
    ggml_type = GGML_TYPES.get(code)
    if ggml_type is None:
        raise _corrupt(reader.path, f"tensor {name!r} has unknown ggml type {code}")
    _check_shape(reader.path, name, dims, ggml_type)
    if code not in MLX_TYPES:
        raise UnsupportedModelError(
            f"{reader.path}: tensor {name!r} has ggml type {ggml_type.name}, which mx.load "
            f"cannot read (it reads {', '.join(GGML_TYPES[t].name for t in sorted(MLX_TYPES))})"
        )
    return _TensorInfo(name, dims, ggml_type, offset)


def _check_shape(path: Path, name: str, dims: tuple[int, ...], ggml_type: GGMLType) -> None:
    elements = 1
    for n in dims:
        if n > MAX_ELEMENTS or (n and elements > MAX_ELEMENTS // n):
            raise _corrupt(path, f"tensor {name!r} has dimensions {list(dims)}, too large")
        elements *= n
    row = dims[0] if dims else 1
    if row % ggml_type.block_size:
        raise _corrupt(
            path,
            f"tensor {name!r} has rows of {row} weights, not a multiple of the "
            f"{ggml_type.block_size}-weight blocks of {ggml_type.name}",
        )


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _check_tensor_data(
    path: Path, tensors: list[_TensorInfo], data_start: int, size: int, alignment: int
) -> None:
    """Every tensor's data aligned, inside the file, and clear of the others."""
    previous: _TensorInfo | None = None
    previous_end = 0
    for tensor in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if tensor.offset % alignment:
            raise _corrupt(
                path,
                f"tensor {tensor.name!r} starts at data offset {tensor.offset}, "
                f"not a multiple of the alignment {alignment}",
            )
        start = data_start + tensor.offset
        end = start + tensor.nbytes
        if end > size:
            raise _corrupt(
                path,
                f"the data of tensor {tensor.name!r} (bytes {start} to {end}) runs past the "
                f"end of the file ({size} bytes): it is truncated or corrupt",
            )
        if previous is not None and start < previous_end and tensor.nbytes:
            raise _corrupt(
                path, f"the data of tensors {previous.name!r} and {tensor.name!r} overlap"
            )
        if tensor.nbytes:
            previous, previous_end = tensor, end
