"""A sequence in the engine: its state, what it holds, and what it has produced."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import mlx.core as mx

from ..kv._pool import AgentBlocks, BlockPool, KVBlock, Reservation
from ..kv._prefix import Piece, Source
from ._prefill import PrefillJob
from ._records import Admission, LogitsProcessor, Sampler, TokenEvent
from ._text import TextStream


class SequenceState(enum.Enum):
    """Where a sequence is."""

    #: Starts at the next step.
    PENDING = "pending"
    #: Waits for a prefill job's checkpoint.
    PARKED = "parked"
    #: Its own prefill job runs.
    JOB = "job"
    #: In the ``BatchGenerator``'s batch.
    RUNNING = "running"
    #: Decoding alone, outside the batch (:class:`Solo`).
    SOLO = "solo"


@attrs.define(eq=False)
class EngineSequence:
    """One submitted sequence, from its plan to its result (the engine's record of it)."""

    uid: int
    agent_id: str
    namespace: Hashable
    #: The whole prompt.
    tokens: list[int]
    #: Tokens of the caller's own cache that agree with the prompt.
    kept: int
    #: The caller's own cache (its agent holds it while the sequence runs).
    own: AgentBlocks | None
    #: The caller's anchors on the prompt's path, and shared prefixes it started from.
    anchors: tuple[int, ...]
    budget: int
    sampler: Sampler | None
    #: Logits processors (penalties, a bias, a constraint); they read the whole
    #: sequence's tokens, history included.
    processors: list[LogitsProcessor]
    #: Record each token's log-probability (``logprobs``), and the ``top`` most likely.
    logprobs: list[float] | None
    top: int
    text: TextStream
    on_token: Callable[[TokenEvent], None] | None
    submitted: float
    state: SequenceState = SequenceState.PENDING
    source: Source = attrs.field(factory=lambda: Source(length=0, layers=()))
    #: References it holds until it finishes: its source's blocks and more.
    held: list[KVBlock] = attrs.Factory(list)
    reservation: Reservation | None = None
    job: PrefillJob | None = None
    waiting: tuple[PrefillJob, int] | None = None
    #: The cache of the checkpoint it waited for (views of the job's), to start from.
    seed: list[Any] | None = None
    admission: Admission | None = None
    gen_uid: int | None = None
    generated: list[int] = attrs.Factory(list)
    prefilled: int = 0
    #: Tokens of its prompt in the batch (its last one included).
    prompt: int = 0
    #: In the batch with prompt tokens left to prefill.
    prompting: bool = False
    first_token: float | None = None
    #: Per layer, the pieces of the cache at ``kept`` (where the turn's new tokens
    #: begin), when they are not the source's: kept as the sliding layers' checkpoint.
    checkpoint: tuple[tuple[Piece, ...], ...] | None = None
    #: References to the checkpoint's blocks, when a prefill job of another made them.
    kept_blocks: list[KVBlock] = attrs.Factory(list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = attrs.Factory(list)

    def release(self, pool: BlockPool) -> None:
        """Give back its reservation and the references it holds."""
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None
        pool.free([*self.held, *self.kept_blocks])
        self.held, self.kept_blocks = [], []


def record_logprobs(seq: EngineSequence, token: int, row: mx.array) -> float:
    """Append ``token``'s log-probability in ``row`` (and the most likely tokens',
    if asked) to ``seq``'s; returns the token's."""
    assert seq.logprobs is not None
    chosen = row[token]
    if seq.top:
        ids = mx.argpartition(-row, seq.top - 1)[: seq.top]
        values = row[ids]
        mx.eval(chosen, ids, values)
        pairs = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]  # type: ignore[arg-type]
        seq.top_logprobs.append(tuple(sorted(pairs, key=lambda p: (-p[1], p[0]))))
    logprob: float = chosen.item()  # type: ignore[assignment]
    seq.logprobs.append(logprob)
    return logprob
