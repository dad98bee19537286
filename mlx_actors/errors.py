"""The exceptions mlx-actors raises: one base class, each type refining the builtin it is."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AgentClosedError",
    "CacheReconstructionError",
    "ContextLengthError",
    "CorruptStateError",
    "EngineError",
    "InvalidRequestError",
    "MlxActorsError",
    "ModelCacheError",
    "ModelIntegrityError",
    "ModelMismatchError",
    "ModelNotFoundError",
    "PoolExhaustedError",
    "ReplicaLostError",
    "ReplyFormatError",
    "RuntimeClosedError",
    "StateInUseError",
    "StateWriteError",
    "TurnTimeoutError",
    "UnknownAgentError",
    "UnsupportedModelError",
]


class MlxActorsError(Exception):
    """Base class of every error mlx-actors raises on purpose."""


class InvalidRequestError(MlxActorsError, ValueError):
    """A request was malformed: empty or non-string text, ``max_tokens <= 0``, a prompt
    longer than the model's context or the whole block pool, a bad agent name..."""


class ContextLengthError(InvalidRequestError):
    """A turn's conversation, with room for its reply, is longer than the model's
    context or than the whole block pool could hold."""


class PoolExhaustedError(MlxActorsError, MemoryError):
    """The block pool has too few free blocks for a turn, and nothing could be evicted."""

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        #: How many blocks the request needed.
        self.needed = needed
        #: How many blocks were free when it asked.
        self.free = free


class ModelNotFoundError(MlxActorsError, FileNotFoundError):
    """A model directory, GGUF file or model id could not be found or fetched."""


class ModelIntegrityError(MlxActorsError, ValueError):
    """A model file failed its checksum, or is corrupt or truncated."""


class ModelCacheError(MlxActorsError, OSError):
    """The model cache directory could not be created or written; point the
    ``MLX_ACTORS_CACHE`` environment variable at a writable directory."""


class CacheReconstructionError(MlxActorsError, ValueError):
    """Cache blocks do not fit the model's cache spec (wrong layer count, shapes or dtype),
    or they were already returned to the pool."""


class UnsupportedModelError(MlxActorsError, ValueError):
    """The model makes a cache type the engine cannot keep exactly as blocks, or is a
    GGUF file of an architecture or tokenizer the converter does not handle."""


class EngineError(MlxActorsError, RuntimeError):
    """The engine failed while running a turn; the turn was dropped and its blocks freed."""

    def __init__(self, message: str, *, uids: Sequence[int] = ()) -> None:
        super().__init__(message)
        #: The engine sequences the failure dropped.
        self.uids = tuple(uids)


class AgentClosedError(MlxActorsError, RuntimeError):
    """The agent was closed (or never existed) when the request reached it."""


class RuntimeClosedError(MlxActorsError, RuntimeError):
    """The runtime shut down before the request could be answered."""


class ReplicaLostError(RuntimeClosedError):
    """A cluster's replica (a process with its own runtime) died with the request in
    flight; its agents come back on another replica from their last saved state, and
    the request can be made again."""


class TurnTimeoutError(MlxActorsError, TimeoutError):
    """A turn did not finish within its timeout; the agent was left as before the turn."""


class UnknownAgentError(MlxActorsError, KeyError):
    """No live agent has that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptStateError(MlxActorsError, ValueError):
    """A file of a runtime's state directory (an agent's conversation or saved cache) is
    corrupt, truncated or not what its index says; the message names the file."""


class ModelMismatchError(MlxActorsError, ValueError):
    """A state directory holds caches made by another model; it was left untouched."""


class StateInUseError(MlxActorsError, RuntimeError):
    """Another runtime (in this process or another) has the state directory open."""


class StateWriteError(MlxActorsError, OSError):
    """The state directory could not be written (a full disk, a read-only directory, no
    permission): the turn, spawn, fork or reset that needed the write did not happen,
    and the agent is as it was before it."""


class ReplyFormatError(MlxActorsError, ValueError):
    """A reply asked for with ``schema=`` did not complete as the schema's JSON: it was
    cut by ``max_tokens`` or a stop string. The turn was undone; ``text`` is what came."""

    def __init__(self, message: str, *, text: str) -> None:
        super().__init__(message)
        self.text = text
