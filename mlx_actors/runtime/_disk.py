"""Files of a runtime's state: atomic writes, safetensors without pickle or MLX, and the
store that keeps agents' caches on disk as chunks listed by an index."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ..errors import CorruptStateError
from ..scheduler import BlockEntry, CacheImage

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


# -- the cache store -----------------------------------------------------------------------


def _digest(index: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()


_CHUNK = re.compile(r"chunk-(\d+)\.safetensors")


class DiskCacheStore:
    """Agents' caches on disk, under ``root/<agent>/``: chunk files of blocks (safetensors)
    and ``index.json``, which lists every block of the cache with the chunk that holds it
    and each chunk's checksum. The index is written last, atomically, so a cache on disk
    is always a complete one; chunks no index refers to are deleted.

    A save writes one new chunk with the blocks the image carries; blocks saved before
    are only listed again. All file work runs on worker threads.

    Args:
        root: the directory (created if missing).
        persistent: whether a cache stays after it is loaded back (a state directory)
            or is deleted (a swap area for caches evicted from the pool).
    """

    def __init__(self, root: Path, *, persistent: bool) -> None:
        self.root = root
        self.persistent = persistent

    def agents(self) -> list[str]:
        """Agents with a cache on disk."""
        return (
            sorted(p.parent.name for p in self.root.glob("*/index.json"))
            if self.root.is_dir()
            else []
        )

    def tokens(self, agent: str) -> tuple[int, ...]:
        index = self._index(agent)
        return tuple(index["tokens"]) if index is not None else ()

    async def save(self, agent: str, image: CacheImage) -> Mapping[int, str]:
        return await anyio.to_thread.run_sync(self._save, agent, image)

    async def load(self, agent: str) -> CacheImage:
        return await anyio.to_thread.run_sync(self._load, agent)

    async def drop(self, agent: str) -> None:
        await anyio.to_thread.run_sync(shutil.rmtree, self.root / agent, True)

    async def copy(self, agent: str, other: str) -> None:
        await anyio.to_thread.run_sync(self._copy, agent, other)

    def _index(self, agent: str) -> dict[str, Any] | None:
        path = self.root / agent / "index.json"
        if not path.is_file():
            return None
        try:
            index = read_json(path)
        except OSError as exc:
            raise CorruptStateError(f"{path} cannot be read: {exc}") from exc
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CorruptStateError(f"{path} is not a cache index of format {FORMAT}")
        if index.pop("sha256", None) != _digest(index) or index.get("agent") != agent:
            raise CorruptStateError(f"{path} does not match its checksum: corrupt or edited")
        return index

    def where(self, agent: str) -> Path:
        """The index file of the agent's cache."""
        return self.root / agent / "index.json"

    def _save(self, agent: str, image: CacheImage) -> dict[int, str]:
        directory = self.root / agent
        make_dir(directory)
        old = self._index(agent) or {}
        chunks: dict[str, str] = dict(old.get("chunks", {}))
        refs: dict[int, str] = {}
        if image.arrays:
            numbers = [
                int(m.group(1)) for p in directory.iterdir() if (m := _CHUNK.fullmatch(p.name))
            ]
            name = f"chunk-{max(numbers, default=0) + 1}.safetensors"
            tensors = {}
            for key, (k, v) in image.arrays.items():
                tensors[f"{key}.keys"], tensors[f"{key}.values"] = k, v
                refs[key] = f"{name}:{key}"
            meta = {"agent": agent, "format": str(FORMAT)}
            data = b"".join(safetensors_bytes(tensors, image.dtype, meta))
            chunks[name] = piecewise_sha256(data)
            write_atomic(directory / name, data)
        layers: list[list[tuple[int, int, str]]] = []
        for entries in image.layers:
            row = []
            for e in entries:
                ref = e.ref or refs.get(e.key)
                if ref is None or ref.split(":")[0] not in chunks:
                    raise CorruptStateError(f"block {e.key} of agent {agent!r} is in no chunk")
                refs[e.key] = ref
                row.append((e.start, e.end, ref))
            layers.append(row)
        used = {ref.split(":")[0] for row in layers for _, _, ref in row}
        index: dict[str, Any] = {
            "format": FORMAT,
            "agent": agent,
            "dtype": image.dtype,
            "tokens": list(image.tokens),
            "anchors": list(image.anchors),
            "layers": layers,
            "chunks": {name: chunks[name] for name in sorted(used)},
        }
        index["sha256"] = _digest(index)
        write_json(directory / "index.json", index)
        for path in directory.iterdir():  # chunks of older saves that nothing refers to
            if path.name != "index.json" and path.name not in used:
                path.unlink(missing_ok=True)
        return refs

    def _copy(self, agent: str, other: str) -> None:
        """``other``'s cache becomes ``agent``'s: the chunks linked (they never change once
        written), or copied where links are not possible; then the index."""
        index = self._index(agent)
        if index is None:
            raise CorruptStateError(f"{self.where(agent)} is missing")
        source, target = self.root / agent, self.root / other
        shutil.rmtree(target, ignore_errors=True)
        make_dir(target)
        for name in index["chunks"]:
            try:
                os.link(source / name, target / name)
            except OSError:
                shutil.copyfile(source / name, target / name)
        index["agent"] = other
        index["sha256"] = _digest(index)
        write_json(target / "index.json", index)

    def _load(self, agent: str) -> CacheImage:
        index = self._index(agent)
        if index is None:
            raise CorruptStateError(f"{self.root / agent / 'index.json'} is missing")
        directory = self.root / agent
        where = directory / "index.json"
        try:
            chunks = {
                name: read_safetensors(directory / name, sha)[0]
                for name, sha in index["chunks"].items()
            }
            keys: dict[str, int] = {}
            arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            layers = []
            for number, row in enumerate(index["layers"]):
                entries = []
                for start, end, ref in row:
                    key = keys.get(ref)
                    if key is None:
                        key = keys[ref] = len(keys)
                        name, tensor = ref.split(":")
                        arrays[key] = (
                            chunks[name][f"{tensor}.keys"],
                            chunks[name][f"{tensor}.values"],
                        )
                    entries.append(
                        BlockEntry(layer=number, start=int(start), end=int(end), key=key, ref=ref)
                    )
                layers.append(tuple(entries))
            tokens = tuple(int(t) for t in index["tokens"])
            anchors = tuple(int(a) for a in index.get("anchors", ()))
            dtype = str(index["dtype"])
        except OSError as exc:
            raise CorruptStateError(f"a chunk listed by {where} cannot be read: {exc}") from exc
        except (AttributeError, KeyError, ValueError, TypeError) as exc:
            raise CorruptStateError(f"{where} does not describe its chunks: {exc!r}") from exc
        return CacheImage(
            tokens=tokens, layers=tuple(layers), dtype=dtype, arrays=arrays, anchors=anchors
        )
