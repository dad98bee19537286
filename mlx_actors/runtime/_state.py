"""A runtime's state directory: which model made its caches, each agent's conversation,
and (in ``caches/``) each agent's KV cache."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
from typing import Any

import anyio
import attrs

from ..actors import check_name
from ..errors import (
    CorruptStateError,
    InvalidRequestError,
    ModelMismatchError,
    StateInUseError,
)
from ._default import sha256_of
from ._disk import FORMAT, make_dir, read_json, write_json
from ._store import DiskCacheStore

#: ``persist=`` values: save after every turn, or only when leaving the runtime.
PERSIST_MODES = ("turn", "exit")


@attrs.frozen(kw_only=True)
class AgentRecord:
    """An agent as saved: its settings and conversation."""

    name: str
    system: str | None
    options: dict[str, Any]
    messages: list[dict[str, str]]
    turns: int

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, path: Path, data: Any) -> AgentRecord:
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            messages = [
                {"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]
            ]
            name = check_name(data["name"])
            if path.stem != name:
                raise ValueError(f"it names the agent {name!r}")
            return cls(
                name=name,
                system=None if data["system"] is None else str(data["system"]),
                options=dict(data["options"]),
                messages=messages,
                turns=int(data["turns"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError, InvalidRequestError) as exc:
            raise CorruptStateError(f"{path} is not an agent record: {exc!r}") from exc


class StateDir:
    """The files of one state directory::

        runtime.json        the model that made the caches (weights checksum)
        agents/NAME.json    each agent's settings and conversation
        caches/NAME/        each agent's KV cache (index.json and chunks)

    Nothing is written until :meth:`claim` has checked the model.
    """

    def __init__(self, path: str | os.PathLike[str], *, persist: str) -> None:
        if persist not in PERSIST_MODES:
            raise InvalidRequestError(f"persist must be one of {PERSIST_MODES}, got {persist!r}")
        self.path = Path(path).expanduser()
        self.persist = persist
        if self.path.exists() and not self.path.is_dir():
            raise InvalidRequestError(f"state_dir {self.path} exists and is not a directory")
        self._agents = self.path / "agents"
        self._fd: int | None = None

    def claim(self, model_dir: Path) -> None:
        """Check that the directory's caches were made by the model in ``model_dir`` (or
        that it holds none yet), then record the model. A mismatch raises
        :class:`ModelMismatchError` and leaves the directory as it was.

        The directory stays locked (``flock``) until :meth:`release`: a second runtime
        on it gets :class:`StateInUseError`."""
        make_dir(self.path)
        self._lock()
        try:
            self._check_and_record(model_dir)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _lock(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StateInUseError(
                f"another runtime has the state directory {self.path} open; close it first, "
                "or choose another state_dir"
            ) from exc
        self._fd = fd

    def _check_and_record(self, model_dir: Path) -> None:
        marker = self.path / "runtime.json"
        known = read_json(marker) if marker.is_file() else {}
        if not isinstance(known, dict):
            raise CorruptStateError(f"{marker} is not a runtime record")
        sha256 = weights_checksum(model_dir, known.get("weights", {}))
        recorded = known.get("weights_sha256")
        if recorded is not None and recorded != sha256:
            raise ModelMismatchError(
                f"{self.path} holds caches made by the model {known.get('model')!r} (weights "
                f"sha256 {recorded[:16]}...), not by {model_dir} ({sha256[:16]}...); open it "
                "with that model, or choose another state_dir"
            )
        make_dir(self._agents)
        # What a process killed in the middle of a write left behind.
        for leftover in [*self._agents.glob(".*.tmp"), *self.path.glob("caches/*/.*.tmp")]:
            leftover.unlink(missing_ok=True)
        files = _weight_files(model_dir)
        write_json(
            marker,
            {
                "format": FORMAT,
                "model": str(model_dir),
                "weights_sha256": sha256,
                "weights": {p.name: [*_stamp(p), _sha_cache(known, p)] for p in files},
            },
        )

    def caches(self) -> DiskCacheStore:
        return DiskCacheStore(self.path / "caches", persistent=self.persist == "turn")

    def records(self) -> list[AgentRecord]:
        """Every saved agent, by name (a corrupt record raises :class:`CorruptStateError`)."""
        out, seen = [], set()
        for path in sorted(self._agents.glob("*.json")):
            record = AgentRecord.from_json(path, read_json(path))
            if record.name.casefold() in seen:
                raise CorruptStateError(f"{path} repeats an agent name (names ignore case)")
            seen.add(record.name.casefold())
            out.append(record)
        return out

    async def save(self, record: AgentRecord) -> None:
        path = self._agents / f"{record.name}.json"
        await anyio.to_thread.run_sync(write_json, path, record.to_json())

    async def delete(self, name: str) -> None:
        path = self._agents / f"{name}.json"
        await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".gguf"))


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _sha_cache(known: dict[str, Any], path: Path) -> str:
    entry = known.get("weights", {}).get(path.name)
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == _stamp(path):
        return str(entry[2])
    return sha256_of(path)


def weights_checksum(model_dir: Path, known: dict[str, Any] | None = None) -> str:
    """One sha256 over the model's weight files. A file whose size and modification time
    match what ``known`` recorded is not read again."""
    files = _weight_files(model_dir)
    if not files:
        raise InvalidRequestError(f"{model_dir} holds no weight files to identify the model by")
    record = {"weights": known or {}}
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{_sha_cache(record, path)}\n".encode())
    return digest.hexdigest()
