"""A runtime's state directory: which model made its caches, each agent's conversation,
and (in ``caches/``) each agent's KV cache."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import anyio
import attrs

from ..actors import Message, TurnOptions, check_name, check_parameters, check_tool_name
from ..errors import (
    CorruptStateError,
    InvalidRequestError,
    ModelMismatchError,
    StateInUseError,
    UnknownAgentError,
)
from ..scheduler import MAX_STOP_CHARS, MAX_STOPS, SEEDS
from ._default import sha256_of
from ._disk import (
    checked,
    dirs_in,
    files_in,
    make_dir,
    read_json,
    real_dir,
    replaced,
    still_real,
    with_digest,
    write_json,
    writing,
)
from ._store import BLOCKS, DiskCacheStore

#: ``persist=`` values: save after every turn, or only when leaving the runtime.
PERSIST_MODES = ("turn", "exit")
#: The format of agent records and ``runtime.json`` (1 had no checksum; still read).
FORMAT = 2
_OPTIONS = {a.name for a in attrs.fields(TurnOptions)}
#: The options every record has (those added later take their defaults).
_FIRST_OPTIONS = {"max_tokens", "temperature", "top_p", "seed", "stop"}


@attrs.frozen(kw_only=True)
class AgentRecord:
    """An agent as saved: its settings and conversation."""

    name: str
    system: str | None
    options: TurnOptions
    #: Each as :meth:`Message.as_dict` gives it.
    messages: list[dict[str, Any]]
    turns: int
    #: The agent's tools as the model was told of them (their functions are not saved).
    tools: list[dict[str, Any]] = attrs.Factory(list)

    def to_json(self) -> dict[str, Any]:
        options = {
            **attrs.asdict(self.options),
            "stop": list(self.options.stop),
            "logit_bias": [list(pair) for pair in self.options.logit_bias],
        }
        record = {**attrs.asdict(self, recurse=False), "options": options}
        return with_digest({"format": FORMAT, **record})

    def write(self, path: Path) -> None:
        """Write the record to ``path`` (compact JSON: several times faster to encode
        than indented, which a long conversation feels on every turn)."""
        write_json(path, self.to_json(), readable=False)

    @classmethod
    def from_json(cls, path: Path, data: Any) -> AgentRecord:
        try:
            if not isinstance(data, dict):
                raise ValueError(f"it holds {type(data).__name__}, not an object")
            if data.get("format") not in (1, FORMAT):
                raise ValueError(f"format {data.get('format')!r}")
            if data["format"] == FORMAT:
                data = checked(path, data)
            messages = [Message.from_dict(m).as_dict() for m in data["messages"]]
            if any(m["role"] not in ("user", "assistant", "tool") for m in messages):
                raise ValueError("a message's role is not 'user', 'assistant' or 'tool'")
            tools = [
                {
                    "name": check_tool_name(t["name"]),
                    "description": _text(t["description"]),
                    "parameters": dict(check_parameters(t["name"], t["parameters"])),
                }
                for t in data.get("tools", [])
            ]
            if len({t["name"] for t in tools}) != len(tools):
                raise ValueError("two tools have the same name")
            name = check_name(data["name"])
            if path.stem != name:
                raise ValueError(f"it names the agent {name!r}")
            options = dict(data["options"])
            if not _FIRST_OPTIONS <= set(options) <= _OPTIONS:
                raise ValueError(f"its options are {sorted(options)}, not {sorted(_OPTIONS)}")
            stop = options["stop"]
            if not isinstance(stop, list):
                raise ValueError(f"stop is {stop!r}")
            if data["format"] == 1:  # the older version took any seed and stop list
                stop = [s for s in stop if isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS]
                stop = stop[:MAX_STOPS]
                seed = options["seed"]
                if isinstance(seed, int) and not isinstance(seed, bool):
                    options["seed"] = seed % SEEDS
            turns = data["turns"]
            if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
                raise ValueError(f"turns is {turns!r}")
            system = None if data["system"] is None else _text(data["system"])
            for what, value in (("the system prompt", system), ("a message", messages)):
                _check_unicode(what, value)
            _check_unicode("a tool's description", tools)
            return cls(
                name=name,
                system=system,
                options=TurnOptions(**{**options, "stop": tuple(stop)}),
                messages=messages,
                turns=turns,
                tools=tools,
            )
        except CorruptStateError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, InvalidRequestError) as exc:
            raise CorruptStateError(f"{path} is not an agent record: {exc!r}") from exc


def _kv(setting: object) -> str:
    """How a ``kv_cache`` record reads in an error."""
    if isinstance(setting, dict):
        return f"quantized to {setting.get('bits')} bits in groups of {setting.get('group_size')}"
    return "unquantized"


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not text")
    return value


def _holds_state(agents: Path, caches: Path) -> bool:
    """Whether the directories hold an agent record, a cache or a chunk (files left by a
    write that did not finish do not count)."""
    found = [*files_in(agents), *files_in(caches / BLOCKS), *dirs_in(caches)]
    return any(p.name != BLOCKS and not p.name.endswith(".tmp") for p in found)


def _check_unicode(what: str, value: object) -> None:
    """Raise ``ValueError`` if text in ``value`` (JSON data) holds a lone surrogate, which
    JSON can spell but no tokenizer reads (the API refuses such text)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate)") from exc


class StateDir:
    """The files of one state directory::

        runtime.json        the model that made the caches (weights checksum)
        agents/NAME.json    each agent's settings and conversation
        caches/NAME/        each agent's KV cache (index.json and chunks)

    Nothing is written until :meth:`claim` has checked the model. Every record carries
    a checksum; nothing is read, written or deleted through a symbolic link.
    """

    def __init__(self, path: str | os.PathLike[str], *, persist: str) -> None:
        if persist not in PERSIST_MODES:
            raise InvalidRequestError(f"persist must be one of {PERSIST_MODES}, got {persist!r}")
        self.path = Path(path).expanduser().resolve()
        self.persist = persist
        if self.path.exists() and not self.path.is_dir():
            raise InvalidRequestError(f"state_dir {self.path} exists and is not a directory")
        self._agents = self.path / "agents"
        self._fd: int | None = None

    def claim(self, model_dir: Path, kv_cache: dict[str, int] | None = None) -> None:
        """Check that the directory's caches were made by the model in ``model_dir`` (or
        that it holds none yet), then record the model. A mismatch raises
        :class:`ModelMismatchError` and leaves the directory as it was.

        The directory stays locked (``flock``) until :meth:`release`: a second runtime
        on it gets :class:`StateInUseError`."""
        try:
            make_dir(self.path)
            self._lock()
        except OSError as exc:
            raise writing("the state directory", self.path, exc) from exc
        try:
            self._check_and_record(model_dir, kv_cache)
        except OSError as exc:
            self.release()
            raise writing("the state directory", self.path, exc) from exc
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

    def _check_and_record(self, model_dir: Path, kv_cache: dict[str, int] | None) -> None:
        marker = self.path / "runtime.json"
        known = read_json(marker) if os.path.lexists(marker) else {}
        if not isinstance(known, dict):
            raise CorruptStateError(f"{marker} is not a runtime record")
        if known.get("format") == FORMAT:
            known = checked(marker, known)
        if not isinstance(known.get("weights", {}), dict):
            raise CorruptStateError(f"{marker} is not a runtime record")
        sha256 = weights_checksum(model_dir, known.get("weights", {}))
        recorded = known.get("weights_sha256")
        if recorded is not None and recorded != sha256:
            made_by = (
                "other weights at the same path (its files changed since)"
                if known.get("model") == str(model_dir)
                else f"the model {known.get('model')!r}"
            )
            raise ModelMismatchError(
                f"{self.path} holds caches made by {made_by} (weights sha256 "
                f"{str(recorded)[:16]}...), not by {model_dir} ({sha256[:16]}...); open it "
                "with that model, or choose another state_dir"
            )
        if recorded is not None and known.get("kv_cache") != kv_cache:
            raise ModelMismatchError(
                f"{self.path} holds caches {_kv(known.get('kv_cache'))}, and this "
                f"runtime keeps them {_kv(kv_cache)}; open it with the same kv_bits and "
                "kv_group_size, or choose another state_dir"
            )
        for path in (self._agents, self.path / "caches", self.path / "caches" / BLOCKS):
            real_dir(path, self.path)
        caches = self.path / "caches"
        if not known and _holds_state(self._agents, caches):
            raise CorruptStateError(
                f"{marker} is missing, yet {self.path} holds agents or caches: which model "
                "made them is unknown, and another model must not read them; put the file "
                "back, or choose another state_dir"
            )
        # What a process killed in the middle of a write left behind.
        for folder in [self._agents, *dirs_in(caches)]:
            for leftover in files_in(folder):
                if leftover.name.startswith(".") and leftover.name.endswith(".tmp"):
                    leftover.unlink(missing_ok=True)
        files = _weight_files(model_dir)
        write_json(
            marker,
            with_digest(
                {
                    "format": FORMAT,
                    "model": str(model_dir),
                    "weights_sha256": sha256,
                    "weights": {p.name: [*_stamp(p), _sha_cache(known, p)] for p in files},
                    "kv_cache": kv_cache,
                }
            ),
        )

    def identity(self) -> tuple[object, object]:
        """The weights checksum and cache quantization ``runtime.json`` records (``None``
        for either if the directory has none)."""
        marker = self.path / "runtime.json"
        if not os.path.lexists(marker):
            return None, None
        known = read_json(marker)
        if not isinstance(known, dict):
            raise CorruptStateError(f"{marker} is not a runtime record")
        if known.get("format") == FORMAT:
            known = checked(marker, known)
        return known.get("weights_sha256"), known.get("kv_cache")

    def record(self, name: str) -> AgentRecord:
        """The saved record of agent ``name`` (:class:`UnknownAgentError` if none)."""
        for record in self.records():
            if record.name == name:
                return record
        raise UnknownAgentError(f"{self.path} holds no agent called {name!r}")

    def caches(self) -> DiskCacheStore:
        return DiskCacheStore(self.path / "caches", persistent=self.persist == "turn")

    def records(self) -> list[AgentRecord]:
        """Every saved agent, by name (a corrupt record raises :class:`CorruptStateError`)."""
        out, seen = [], set()
        with os.scandir(self._agents) as it:
            paths = sorted(Path(e.path) for e in it if e.name.endswith(".json"))
        for path in paths:
            try:
                data = read_json(path)
            except OSError as exc:
                raise CorruptStateError(f"{path} cannot be read: {exc}") from exc
            record = AgentRecord.from_json(path, data)
            if record.name.casefold() in seen:
                raise CorruptStateError(f"{path} repeats an agent name (names ignore case)")
            seen.add(record.name.casefold())
            out.append(record)
        return out

    async def save(self, record: AgentRecord) -> None:
        """Write the agent's record (:class:`StateWriteError` if it cannot be written)."""
        path = self._agents / f"{record.name}.json"
        if not still_real(self._agents, self.path):
            raise replaced(self._agents)
        try:
            # Encoded on the worker thread: a long conversation's JSON takes milliseconds.
            await anyio.to_thread.run_sync(record.write, path)
        except OSError as exc:
            raise writing(f"agent {record.name!r}", path, exc) from exc

    async def delete(self, name: str) -> None:
        path = self._agents / f"{name}.json"
        if not still_real(self._agents, self.path):
            return  # the agents' folder is not there: nothing of it to delete here
        try:
            await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
        except OSError as exc:
            raise writing(f"agent {name!r}", path, exc) from exc


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
