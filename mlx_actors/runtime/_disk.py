"""Files of a runtime's state: atomic writes, JSON, and safetensors without pickle or MLX."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import io
import json
import math
import os
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptStateError, StateWriteError

#: safetensors dtype codes of the cache dtypes, and numpy types of the same width.
#: The safetensors codes of what blocks hold (``uint16``: quantized blocks, packed).
DTYPE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "uint16": "U16"}
_BITS = {"F16": np.uint16, "BF16": np.uint16, "F32": np.uint32, "U16": np.uint16}
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


#: How a checksum written since XXH3 names its kind (older ones are sha256 hex digests).
XXH3 = "xxh3-128:"


def checksum(data: Any) -> str:
    """The checksum a chunk file is written with: XXH3's 128-bit hash of its bytes
    (``data``: any buffer), at memory speed on one core."""
    return XXH3 + xxhash.xxh3_128(data).hexdigest()


def matches(data: Any, recorded: str) -> bool:
    """Whether ``data`` has the checksum ``recorded``: an XXH3 one, or the sha256 of
    pieces that files written before it carry (:func:`piecewise_sha256`)."""
    if recorded.startswith(XXH3):
        return checksum(data) == recorded
    return piecewise_sha256(data) == recorded


#: sha256 checksums (of files written before XXH3) are taken over pieces of this size,
#: on several threads.
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


# -- staying inside a directory -------------------------------------------------------------
#
# A state directory's files are reached only through real directories: a symbolic link
# in it (planted, or left by a user) is never followed, to read, to write or to delete,
# so that nothing outside the directory is ever touched. Files are opened with
# ``O_NOFOLLOW``; writes replace a link rather than follow it (``rename``); deletes
# remove the link itself.


def real_dir(path: Path, root: Path, *, create: bool = True) -> bool:
    """Whether ``path`` (``root`` or a directory below it) is there, created if missing
    and ``create``; raises :class:`CorruptStateError` if it, ``root`` or a directory
    between them is a symbolic link or not a directory."""
    here = root
    for part in (None, *path.relative_to(root).parts):
        here = here if part is None else here / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            if not create:
                return False
            make_dir(here)
            mode = os.lstat(here).st_mode
        if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
            raise CorruptStateError(
                f"{here} is {what}: a state directory must hold its own files (nothing is "
                "followed out of it); remove it"
            )
    return True


def still_real(path: Path, root: Path) -> bool:
    """Whether ``path`` is still a real directory under ``root``: no symbolic link has
    replaced it, or a folder on the way, since the runtime began. Checked right before
    each write or delete in it (the window between check and use stays)."""
    try:
        return real_dir(path, root, create=False)
    except CorruptStateError:
        return False


def replaced(path: Path) -> CorruptStateError:
    return CorruptStateError(
        f"{path} was replaced (by a symbolic link, or removed) while the runtime ran; "
        "nothing is written or deleted outside the state directory"
    )


def files_in(path: Path) -> list[Path]:
    """The regular files directly in ``path`` (links and directories left out)."""
    with os.scandir(path) as it:
        return [Path(e.path) for e in it if e.is_file(follow_symlinks=False)]


def dirs_in(path: Path) -> list[Path]:
    """The real directories directly in ``path`` (links left out)."""
    with os.scandir(path) as it:
        return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]


def read_file(path: Path) -> bytes:
    """The bytes of ``path``, never through a symbolic link (:class:`CorruptStateError`
    if it is one; ``FileNotFoundError`` if it is missing)."""
    with _opened(path) as f:
        return f.read()


#: Makes the ``uint8`` array of ``size`` bytes a file is read into.
Buffer = Callable[[int], np.ndarray]


#: Files from this size up are read in pieces of :data:`READ_PIECE`, several at once, and
#: an XXH3 checksum runs over each piece as soon as it and those before it are in.
PARALLEL_READ = 16 << 20
READ_PIECE = 4 << 20
_reading = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), "mlx-actors-read")


def read_array(
    path: Path, buffer: Buffer | None = None, recorded: str | None = None
) -> tuple[np.ndarray, bool]:
    """The bytes of ``path`` (as :func:`read_file` opens it), read straight into one
    ``uint8`` array (``buffer(size)``, or a new one): no copy of them is made on the
    way, and the tensors of a safetensors file are views of it. Also whether they
    match the checksum ``recorded`` (:func:`matches`; ``True`` without one).

    A large file is read on several threads (``os.preadv``, each piece into its place),
    the checksum following the pieces in order on this thread: reading and hashing
    overlap, and neither waits for one core's copy of the whole file."""
    with _opened(path) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        data = np.empty(size, dtype=np.uint8) if buffer is None else buffer(size)
        view = data.data
        if size < PARALLEL_READ or not hasattr(os, "preadv"):
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:  # the file shrank while it was read
                    raise CorruptStateError(f"{path} was cut short while it was read")
                done += n
            return data, recorded is None or matches(data, recorded)
        step = READ_PIECE
        starts = range(0, size, step)
        pieces = [_reading.submit(_read_into, path, fd, view[s : s + step], s) for s in starts]
        try:
            xxh3 = recorded is not None and recorded.startswith(XXH3)
            hasher = xxhash.xxh3_128()
            for start, piece in zip(starts, pieces, strict=True):
                piece.result()
                if xxh3:
                    hasher.update(view[start : start + step])
        finally:
            concurrent.futures.wait(pieces)  # none may write into ``data`` after this
        if recorded is None:
            return data, True
        if xxh3:
            return data, XXH3 + hasher.hexdigest() == recorded
        return data, matches(data, recorded)


def _read_into(path: Path, fd: int, view: memoryview, offset: int) -> None:
    """``view``'s length of bytes of the file ``fd`` from ``offset``, into ``view``."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:  # the file shrank while it was read
            raise CorruptStateError(f"{path} was cut short while it was read")
        done += n


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[io.BufferedReader]:
    try:
        # Non-blocking: a FIFO planted there must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptStateError(f"{path} is a symbolic link, which is not followed") from exc
        raise
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptStateError(f"{path} is not a regular file")
        yield f


def writing(what: str, path: Path, exc: OSError) -> StateWriteError:
    """The typed error for a write of the state directory that failed."""
    return StateWriteError(f"could not write {what} ({path}): {exc.strerror or exc}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any, *, readable: bool = True) -> None:
    """Write ``value`` as JSON, atomically: indented for a person to read (small files
    written once), or compact, which Python's JSON encoder writes several times faster
    (in C): what is written on every turn."""
    if readable:
        data = json.dumps(value, indent=1, sort_keys=True)
    else:
        data = json.dumps(value, sort_keys=True, separators=(",", ":"))
    write_atomic(path, data.encode())


def json_digest(value: Mapping[str, Any]) -> str:
    """The checksum a JSON record carries: a sha256 over everything in it but itself."""
    rest = {k: v for k, v in value.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def with_digest(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` with its checksum added (``"sha256"``)."""
    return {**value, "sha256": json_digest(value)}


def checked(path: Path, value: Any) -> dict[str, Any]:
    """``value`` as read from ``path``, a JSON object whose checksum matches, without it
    (:class:`CorruptStateError` otherwise)."""
    if not isinstance(value, dict) or value.get("sha256") != json_digest(value):
        raise CorruptStateError(f"{path} does not match its checksum: corrupt or edited")
    return {k: v for k, v in value.items() if k != "sha256"}


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_file(path))
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
    # Padded so that the tensors start on a 64-byte boundary (safetensors asks for 8):
    # read into aligned memory, each lies where a GPU copy can take it in 16-byte words.
    raw += b" " * (-(8 + len(raw)) % 64)
    yield struct.pack("<Q", len(raw)) + raw
    for a in tensors.values():
        yield np.ascontiguousarray(a).tobytes()


def read_safetensors(
    path: Path, recorded: str | None = None, buffer: Buffer | None = None
) -> tuple[dict[str, np.ndarray], str]:
    """Tensors of a safetensors file (as unsigned bits, views of the file's bytes, read
    into ``buffer(size)`` if given) and their dtype; checks the file's checksum
    (:func:`matches`) and that every tensor lies inside it."""
    try:
        data, matched = read_array(path, buffer, recorded)
    except FileNotFoundError as exc:
        raise CorruptStateError(f"{path} is missing") from exc
    if not matched:
        raise CorruptStateError(f"{path} does not match its checksum: corrupt or truncated")
    try:
        (size,) = struct.unpack_from("<Q", data.data)
        header = json.loads(data[8 : 8 + size].tobytes())
        body = data.data[8 + size :]
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
