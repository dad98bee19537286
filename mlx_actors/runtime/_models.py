"""Model resolution: the default model, a local mlx-lm directory, a GGUF file (converted
once, cached) or a Hugging Face id, and loading the result through ``mlx_lm.load``."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import attrs
from mlx.nn.layers.base import Module

from ..errors import (
    InvalidRequestError,
    MlxActorsError,
    ModelIntegrityError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from ._default import cached_conversion, default_model_dir, sha256_of
from ._trace import ModuleLog

log = ModuleLog()

# A Hugging Face repo id: ``name`` or ``owner/name``, letters, digits and ``-_.``.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@attrs.frozen(kw_only=True, eq=False)  # compared by identity: models are large and mutable
class LoadedModel:
    """A model loaded by :func:`load_model`."""

    #: The mlx-lm model directory it was loaded from.
    path: Path
    #: The mlx-lm model (an ``mlx.nn.Module``).
    model: Module
    #: mlx-lm's ``TokenizerWrapper`` around the model's tokenizer.
    tokenizer: Any
    #: The model's ``config.json``, as mlx-lm read it.
    config: dict[str, Any]


def resolve_model(model: str | os.PathLike[str] | None = None, *, dequantize: bool = False) -> Path:
    """The local mlx-lm model directory for ``model``, fetching or converting it if needed.

    ``model`` may be:

    - ``None``: the default model, SmolLM2-135M-Instruct (see ``default_model_dir``).
    - a directory holding an mlx-lm model (``config.json`` and weights): used as it is.
    - a ``.gguf`` file of a llama model: converted once into the model cache, keyed by
      the file's sha256 (hashing a large file takes a moment on every call).
    - a Hugging Face id such as ``mlx-community/SmolLM2-135M-Instruct-8bit``: fetched
      with ``huggingface_hub.snapshot_download`` (only the local copy when
      ``HF_HUB_OFFLINE`` is set).

    A string that looks like a path (it starts with ``.``, ``~`` or ``/``, or is not
    shaped like ``owner/name``) and names nothing on disk is refused at once, without
    contacting the hub.

    Args:
        model: what to run (see above).
        dequantize: for GGUF models (the default included), convert to float32 weights,
            faster on CPUs and about 5 times larger. Refused for other models.

    Raises:
        ModelNotFoundError: nothing could be found or fetched under that name.
        ModelIntegrityError: a downloaded or given file is corrupt.
        ModelCacheError: the model cache could not be written.
        UnsupportedModelError: a GGUF file of an architecture the converter lacks.
        InvalidRequestError: ``dequantize`` for a model that is not a GGUF file.
    """
    kind = check_model(model, dequantize=dequantize)
    if model is None:
        return default_model_dir(dequantize=dequantize)
    text = os.fspath(model)
    path = Path(text).expanduser()
    if kind == "gguf":
        return _converted_gguf(path, dequantize)
    return path if kind == "directory" else _hub_snapshot(text)


def check_model(model: str | os.PathLike[str] | None, *, dequantize: bool = False) -> str:
    """What ``model`` names (``"default"``, ``"gguf"``, ``"directory"`` or ``"hub"``),
    from the checks :func:`resolve_model` can make at once, without fetching, converting
    or loading anything.

    Raises:
        ModelNotFoundError: a path that names nothing usable.
        InvalidRequestError: ``dequantize`` for a model that is not a GGUF file.
    """
    if model is None:
        return "default"
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not an mlx-lm model directory")
        kind = "directory"
    elif path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    elif isinstance(model, os.PathLike) or not _HUB_ID.fullmatch(text) or text.endswith(".gguf"):
        raise ModelNotFoundError(f"no model at {path}: no such file or directory")
    else:
        kind = "hub"
    if dequantize:
        raise InvalidRequestError(f"dequantize applies to GGUF models only, not to {text!r}")
    return kind


def load_model(
    model: str | os.PathLike[str] | None = None, *, dequantize: bool = False
) -> LoadedModel:
    """Resolve ``model`` (see :func:`resolve_model`) and load it with ``mlx_lm.load``.

    The weights are read into memory before it returns. All MLX work of the model must
    then stay on the thread that called this (MLX is not thread-safe).
    """
    import mlx_lm

    path = resolve_model(model, dequantize=dequantize)
    started = time.monotonic()
    try:
        loaded, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"incomplete model directory {path}: {exc}") from exc
    except MlxActorsError:
        raise
    except Exception as exc:  # what a broken directory raises, from mlx-lm or below
        raise _load_error(path, exc) from exc
    log.info("model.loaded", path=str(path), seconds=round(time.monotonic() - started, 2))
    _quiet_length_warning(tokenizer)
    return LoadedModel(path=path, model=loaded, tokenizer=tokenizer, config=config)


def _quiet_length_warning(tokenizer: Any) -> None:
    """Keep transformers from printing "Token indices sequence length is longer than
    the specified maximum..." when a text longer than the model's context is tokenised:
    the runtime refuses such a turn itself (:class:`ContextLengthError`), and the
    warning would reach stderr before that error. (Transformers warns once per
    tokenizer, and records that it did in this dictionary.)"""
    warned = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def _load_error(path: Path, exc: Exception) -> MlxActorsError:
    """The typed error for a model directory mlx-lm could not load: a model type it
    lacks, or files that do not add up (bad JSON, missing config fields, truncated or
    mismatched weights, a broken tokenizer)."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError) and "not supported" in str(exc):
        return UnsupportedModelError(f"mlx-lm cannot run the model in {path}: {detail}")
    return ModelIntegrityError(
        f"{path} is not a loadable mlx-lm model (corrupt, truncated or incomplete): {detail}"
    )


def _converted_gguf(path: Path, dequantize: bool) -> Path:
    started = time.monotonic()
    sha256 = sha256_of(path)
    log.debug("model.hashed", path=str(path), seconds=round(time.monotonic() - started, 2))
    form = "float32" if dequantize else "as-stored"
    return cached_conversion(
        f"gguf-{sha256[:16]}-{form}",
        source_sha256=sha256,
        dequantize=dequantize,
        source=lambda _work: path,
        description=str(path.resolve()),
    )


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    # huggingface_hub reads HF_HUB_OFFLINE once, at import: honour it as it is now.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        local = Path(
            snapshot_download(
                repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS, local_files_only=offline
            )
        )
    except Exception as exc:  # offline, unknown or gated repo, bad id...: all "not found"
        where = "in the local Hugging Face cache" if offline else "on the Hugging Face hub"
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path, and fetching it {where} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (local / "config.json").is_file():
        raise ModelNotFoundError(f"{repo_id!r} on the Hugging Face hub has no config.json")
    return local
