"""Agents' caches on disk: chunk files of blocks shared by every agent, and one index per
agent listing its blocks; a block is stored once, however many agents hold it."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ..actors import NAME
from ..errors import CorruptStateError
from ..scheduler import BLOCK_SIZE, BlockEntry, CacheImage, host_memory
from ._disk import (
    checked,
    checksum,
    dirs_in,
    files_in,
    read_json,
    read_safetensors,
    real_dir,
    replaced,
    safetensors_bytes,
    still_real,
    with_digest,
    write_atomic,
    write_json,
    writing,
)

#: The format of cache indexes (1 kept the chunks in each agent's directory; 2 listed
#: the tokens as numbers, which 3 packs: still read).
CACHE_FORMAT = 3
_READ_FORMATS = (2, CACHE_FORMAT)
#: The directory of the chunks (not an agent name: those start with a letter).
BLOCKS = "_blocks"
_CHUNK = re.compile(r"chunk-(\d+)\.safetensors")


#: An agent's last save's tokens and the content key of each of its blocks, by
#: ``(layer, start, end)``: a save reuses the keys of the blocks whose tokens it shares.
KnownKeys = tuple[np.ndarray, dict[tuple[int, int, int], str]]


def content_keys(
    tokens: Sequence[int], blocks: Iterable[tuple[int, int, int]], known: KnownKeys | None = None
) -> tuple[list[str], KnownKeys]:
    """A key per block ``(layer, start, end)``: what it holds is fixed by the model, the
    tokens up to its end, its layer and its first position, so two agents' blocks with
    the same key hold the same keys and values. The tokens are hashed in a chain over
    256-token chunks, as the engine's prefix index walks them. A block of ``known``
    (what the call that made it returned) whose tokens up to its end are these too
    keeps its key, not hashed again: a turn's save hashes the blocks it changed. Also
    returns what to pass as ``known`` next time."""
    data = np.asarray(tokens, dtype="<u4")
    spans = list(blocks)
    same, reuse = 0, dict[tuple[int, int, int], str]()
    if known is not None:
        old, reuse = known
        n = min(len(old), len(data))
        differ = np.flatnonzero(old[:n] != data[:n])
        same = int(differ[0]) if differ.size else n
    chain = [hashlib.sha256(b"mlx-actors blocks").digest()]
    keys = []
    for layer, start, end in spans:
        key = reuse.get((layer, start, end)) if end <= same else None
        if key is None:
            depth = (end - 1) // BLOCK_SIZE
            while len(chain) <= depth:
                k = len(chain) - 1
                piece = data[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE].tobytes()
                chain.append(hashlib.sha256(chain[k] + piece).digest())
            digest = hashlib.sha256(chain[depth] + data[depth * BLOCK_SIZE : end].tobytes())
            key = f"{digest.hexdigest()}:{layer}:{start}"
        keys.append(key)
    return keys, (data, dict(zip(spans, keys, strict=True)))


class DiskCacheStore:
    """Agents' caches under ``root``: ``root/_blocks/chunk-N.safetensors`` hold blocks,
    ``root/<agent>/index.json`` lists an agent's blocks (layer, positions, where each is,
    what it holds) and the checksum of each chunk it uses.

    A save writes one new chunk with the blocks no chunk holds yet (a block another
    agent saved is found by what it holds and referred to), then the index, last and
    atomically, so a cache on disk is always complete. A chunk is deleted when no index
    lists it any more; the store counts which agents use which chunk (one runtime has the
    directory), and at the first use deletes the chunks no index lists (what a process
    killed between the two writes left). All file work runs on worker threads.

    Args:
        root: the directory (created if missing).
        persistent: whether a cache stays after it is loaded back (a state directory)
            or is deleted (a swap area for caches evicted from the pool).
    """

    def __init__(self, root: Path, *, persistent: bool) -> None:
        self.root = root
        self.blocks = root / BLOCKS
        self.persistent = persistent
        self._lock = threading.Lock()
        self._ready = False
        self._uses: dict[str, set[str]] = {}  # agent -> chunks its index lists
        self._users: dict[str, set[str]] = {}  # chunk -> agents whose index lists it
        self._content: dict[str, str] = {}  # content key -> where the block is
        self._keys: dict[str, set[str]] = {}  # chunk -> content keys it holds
        self._sha: dict[str, str] = {}  # chunk -> its checksum
        self._bad: set[str] = set()  # chunks found corrupt: never referred to again
        self._writing: dict[str, threading.Event] = {}  # chunks being written
        self._next = 1
        self._known: dict[str, KnownKeys] = {}  # agent -> its last save's content keys

    # -- the async face ------------------------------------------------------------------

    def agents(self) -> list[str]:
        """Agents with a cache on disk."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in dirs_in(self.root)
            if NAME.fullmatch(p.name) and (p / "index.json").exists()
        )

    def tokens(self, agent: str) -> tuple[tuple[int, ...], int]:
        """The tokens ``agent``'s saved cache holds, and its number of blocks."""
        index = self._index(agent)
        if index is None:
            return (), 0
        try:
            return _tokens(index), sum(len(row) for row in index["layers"])
        except (KeyError, TypeError, ValueError) as exc:
            where = self.where(agent)
            raise CorruptStateError(f"{where} does not describe its chunks: {exc!r}") from exc

    async def save(self, agent: str, image: CacheImage) -> Mapping[int, str]:
        try:
            return await anyio.to_thread.run_sync(self._save, agent, image)
        except OSError as exc:
            raise writing(f"the cache of agent {agent!r}", self.where(agent), exc) from exc

    async def load(self, agent: str) -> CacheImage:
        # Abandoned if the turn that waits for it is cancelled: a stalled disk never
        # holds a caller past its timeout (reading changes nothing).
        return await anyio.to_thread.run_sync(self._load, agent, abandon_on_cancel=True)

    async def drop(self, agent: str) -> None:
        await anyio.to_thread.run_sync(self._drop, agent)

    async def copy(self, agent: str, other: str) -> None:
        await anyio.to_thread.run_sync(self._copy, agent, other)

    def where(self, agent: str) -> Path:
        """The index file of the agent's cache."""
        return self.root / agent / "index.json"

    # -- indexes ---------------------------------------------------------------------------

    def _index(self, agent: str) -> dict[str, Any] | None:
        """The agent's index, checked (``None`` if it has none, or one of an older
        format, which the first use of the store deletes)."""
        path = self.where(agent)
        if not real_dir(path.parent, self.root, create=False) or not os.path.lexists(path):
            return None
        try:
            index = read_json(path)
        except OSError as exc:
            raise CorruptStateError(f"{path} cannot be read: {exc}") from exc
        if isinstance(index, dict) and index.get("format") == 1:
            return None
        if not isinstance(index, dict) or index.get("format") not in _READ_FORMATS:
            raise CorruptStateError(f"{path} is not a cache index of format {CACHE_FORMAT}")
        index = checked(path, index)
        if index.get("agent") != agent:
            raise CorruptStateError(f"{path} is the cache index of {index.get('agent')!r}")
        _check_refs(path, index)
        return index

    def _ensure_ready(self) -> None:
        """Learn which agents use which chunks (under the lock, once)."""
        if self._ready:
            return
        real_dir(self.blocks, self.root)
        all_read = True
        for agent in self.agents():
            try:
                index = self._index(agent)
            except CorruptStateError:
                all_read = False  # its agent's next turn reports it
                continue
            if index is None:  # an older format: its chunks were in its directory
                _remove(self.root / agent)
                continue
            self._use(agent, index)
        present = {p.name for p in files_in(self.blocks)}
        for chunk in set(self._users) - present:  # listed, but gone (found corrupt before)
            self._forget(chunk)
        names = present | set(self._users)
        numbers = [int(m.group(1)) for name in names if (m := _CHUNK.fullmatch(name))]
        self._next = max(numbers, default=0) + 1  # no name an index lists is made again
        if all_read:  # what a process killed between a chunk and its index left
            for path in files_in(self.blocks):
                if path.name not in self._users:
                    path.unlink(missing_ok=True)
        self._ready = True

    def _use(self, agent: str, index: Mapping[str, Any]) -> None:
        chunks = set(index["chunks"])
        self._uses[agent] = chunks
        for chunk in chunks:
            self._users.setdefault(chunk, set()).add(agent)
            if chunk not in self._bad:
                self._sha.setdefault(chunk, str(index["chunks"][chunk]))
        for row in index["layers"]:
            for _, _, ref, key in row:
                chunk = ref.split(":")[0]
                if chunk not in self._bad:
                    self._content.setdefault(key, ref)
                    self._keys.setdefault(chunk, set()).add(key)

    def _release(self, agent: str, chunks: Iterable[str]) -> None:
        """``agent`` no longer lists ``chunks``: delete those nobody lists."""
        for chunk in chunks:
            users = self._users.get(chunk)
            if users is None:
                continue
            users.discard(agent)
            if not users:
                del self._users[chunk]
                self._sha.pop(chunk, None)
                for key in self._keys.pop(chunk, ()):
                    if self._content.get(key, "").startswith(f"{chunk}:"):
                        del self._content[key]
                if still_real(self.blocks, self.root):
                    (self.blocks / chunk).unlink(missing_ok=True)

    # -- saving ----------------------------------------------------------------------------

    def _save(self, agent: str, image: CacheImage) -> dict[int, str]:
        entries = [e for row in image.layers for e in row]
        spans = ((e.layer, e.start, e.end) for e in entries)
        keys, known = content_keys(image.tokens, spans, self._known.get(agent))
        refs: dict[int, str] = {}
        missing: dict[int, str] = {}  # block -> content key, for blocks no chunk holds
        with self._lock:
            self._ensure_ready()
            old = self._uses.get(agent, set())
            chunk = f"chunk-{self._next}.safetensors"
            for e, key in zip(entries, keys, strict=True):
                held = e.ref.split(":")[0] if e.ref is not None else None
                ref = e.ref if held in old and held not in self._bad else None
                ref = ref or self._content.get(key)
                if ref is not None:
                    refs[e.key] = ref
                elif e.key not in image.arrays:
                    raise CorruptStateError(
                        f"block {e.key} of agent {agent!r} is in no chunk and was not given"
                    )
                elif e.key not in missing:
                    # Claimed now, so that a save running beside this one refers to it
                    # (and waits for the chunk) instead of writing it again.
                    missing[e.key] = key
                    refs[e.key] = self._content[key] = f"{chunk}:{len(missing) - 1}"
                    self._keys.setdefault(chunk, set()).add(key)
            if missing:
                self._next += 1
                self._writing[chunk] = threading.Event()
            listed = {ref.split(":")[0] for ref in refs.values()}
            waits = [self._writing[c] for c in listed - {chunk} if c in self._writing]
            for name in listed:  # pinned: no other agent's save deletes them meanwhile
                self._users.setdefault(name, set()).add(agent)
        try:
            if missing:
                try:
                    self._write_chunk(chunk, image, missing)
                finally:
                    self._writing.pop(chunk).set()
            for event in waits:
                event.wait()
            with self._lock:
                gone = [c for c in listed if c not in self._sha]
                if gone:
                    raise OSError(f"the chunks {gone} this cache shares could not be written")
                sums = {name: self._sha[name] for name in listed}
            index: dict[str, Any] = {
                "format": CACHE_FORMAT,
                "agent": agent,
                "dtype": image.dtype,
                "tokens": _packed(known[0]),  # the tokens as content_keys read them
                "anchors": list(image.anchors),
                "layers": _rows(image.layers, refs, keys),
                "chunks": {name: sums[name] for name in sorted(listed)},
            }
            real_dir(self.root / agent, self.root)
            write_json(self.where(agent), with_digest(index), readable=False)
        except BaseException:
            with self._lock:
                self._release(agent, listed - old)
            raise
        with self._lock:
            self._uses[agent] = listed
            self._release(agent, old - listed)
            self._known[agent] = known
        return refs

    def _write_chunk(self, chunk: str, image: CacheImage, blocks: Mapping[int, str]) -> None:
        """Write ``blocks`` of ``image`` as ``chunk`` (the tensors numbered in order);
        if that fails, forget what it was to hold."""
        try:
            tensors = {}
            for number, block in enumerate(blocks):
                k, v = image.arrays[block]
                tensors[f"{number}.keys"], tensors[f"{number}.values"] = k, v
            meta = {"format": str(CACHE_FORMAT)}
            data = b"".join(safetensors_bytes(tensors, image.dtype, meta))
            sha = checksum(data)
            if not still_real(self.blocks, self.root):
                raise replaced(self.blocks)
            write_atomic(self.blocks / chunk, data)
        except BaseException:
            with self._lock:
                for key in self._keys.pop(chunk, ()):
                    if self._content.get(key, "").startswith(f"{chunk}:"):
                        del self._content[key]
            raise
        with self._lock:
            self._sha[chunk] = sha

    # -- the rest ----------------------------------------------------------------------------

    def _drop(self, agent: str) -> None:
        with self._lock:
            self._ensure_ready()
            if still_real(self.root, self.root):
                _remove(self.root / agent)
            self._release(agent, self._uses.pop(agent, set()))
            self._known.pop(agent, None)

    def _copy(self, agent: str, other: str) -> None:
        """``other``'s cache becomes ``agent``'s: the same chunks, its own index."""
        with self._lock:
            self._ensure_ready()
            index = self._index(agent)
            if index is None:
                raise CorruptStateError(f"{self.where(agent)} is missing")
            self._release(other, self._uses.pop(other, set()))
            index["agent"] = other
            real_dir(self.root / other, self.root)
            write_json(self.where(other), with_digest(index), readable=False)
            self._use(other, index)

    def _read_chunk(self, name: str, sha: object) -> dict[str, np.ndarray]:
        try:
            return read_safetensors(self.blocks / name, str(sha), _host_buffer)[0]
        except CorruptStateError:
            if _CHUNK.fullmatch(name):
                self._never_again(name)
            raise

    def _never_again(self, chunk: str) -> None:
        """Forget ``chunk``, found corrupt, and delete it. The other agents whose
        indexes list it lose their caches when those are read, and start again from
        their conversations; a later start takes a listed chunk that is missing for
        one found corrupt."""
        with self._lock:
            self._forget(chunk)
            if still_real(self.blocks, self.root):
                (self.blocks / chunk).unlink(missing_ok=True)

    def _forget(self, chunk: str) -> None:
        """No save refers to ``chunk`` again (its blocks are written anew), and a save
        under way that refers to it fails rather than list it. Under the lock."""
        self._bad.add(chunk)
        self._sha.pop(chunk, None)
        for key in self._keys.pop(chunk, ()):
            if self._content.get(key, "").startswith(f"{chunk}:"):
                del self._content[key]

    def _load(self, agent: str) -> CacheImage:
        index = self._index(agent)
        where = self.where(agent)
        if index is None:
            raise CorruptStateError(f"{where} is missing")
        try:
            chunks = {name: self._read_chunk(name, sha) for name, sha in index["chunks"].items()}
            keys: dict[str, int] = {}
            arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            layers = []
            for number, row in enumerate(index["layers"]):
                entries = []
                for start, end, ref, _ in row:
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
            tokens = _tokens(index)
            anchors = tuple(int(a) for a in index.get("anchors", ()))
            dtype = str(index["dtype"])
        except OSError as exc:
            raise CorruptStateError(f"a chunk listed by {where} cannot be read: {exc}") from exc
        except (AttributeError, KeyError, ValueError, TypeError) as exc:
            raise CorruptStateError(f"{where} does not describe its chunks: {exc!r}") from exc
        return CacheImage(
            tokens=tokens, layers=tuple(layers), dtype=dtype, arrays=arrays, anchors=anchors
        )


def _packed(tokens: Sequence[int] | np.ndarray) -> str:
    """Tokens as an index lists them: base64 of little-endian 32-bit numbers (a long
    history's numbers one by one cost its save tens of milliseconds of JSON)."""
    return base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode("ascii")


def _tokens(index: Mapping[str, Any]) -> tuple[int, ...]:
    """The tokens an index lists (packed, or as numbers in format 2); ``ValueError`` or
    ``TypeError`` if they are neither."""
    listed = index["tokens"]
    if index["format"] == 2:
        return tuple(int(t) for t in listed)
    if not isinstance(listed, str):
        raise TypeError(f"tokens are {type(listed).__name__}, not packed")
    data = base64.b64decode(listed.encode("ascii"), validate=True)
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes of packed tokens")
    return tuple(np.frombuffer(data, dtype="<u4").tolist())


def _host_buffer(size: int) -> np.ndarray:
    """Memory a chunk file is read into: a slot of the process's host memory for blocks
    (on CUDA page-locked, so that its blocks go from there to the GPU by a kernel), or
    new memory when its slabs are full."""
    memory = host_memory(start=False)  # (on a worker thread: no MLX work here)
    slots = None if memory is None else memory.take([((size,), np.dtype(np.uint8))])
    return np.empty(size, np.uint8) if slots is None else slots[0]


def _rows(
    layers: Sequence[Sequence[BlockEntry]], refs: Mapping[int, str], keys: list[str]
) -> list[list[list[Any]]]:
    """The index's layers: per block, its positions, where it is and what it holds."""
    rows, at = [], 0
    for entries in layers:
        rows.append([[e.start, e.end, refs[e.key], keys[at + i]] for i, e in enumerate(entries)])
        at += len(entries)
    return rows


def _remove(path: Path) -> None:
    """Delete an agent's directory, or only the link if it is one (never what it
    points to)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _check_refs(path: Path, index: Mapping[str, Any]) -> None:
    """Every chunk an index names is a chunk file's name (so no path leads elsewhere),
    and every block it lists refers to one of them."""
    try:
        chunks = index["chunks"]
        if not all(isinstance(c, str) and _CHUNK.fullmatch(c) for c in chunks):
            raise ValueError(f"chunk names {sorted(map(str, chunks))}")
        for row in index["layers"]:
            for start, end, ref, key in row:
                name, _, tensor = str(ref).partition(":")
                if name not in chunks or not tensor.isdigit():
                    raise ValueError(f"block reference {ref!r}")
                if not (isinstance(start, int) and isinstance(end, int) and isinstance(key, str)):
                    raise ValueError(f"block {[start, end, ref, key]!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptStateError(f"{path} does not describe its chunks: {exc!r}") from exc
