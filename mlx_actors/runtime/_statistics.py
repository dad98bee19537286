"""RuntimeStatistics: what a runtime has done, as :meth:`Runtime.stats` reports it, read
from its scheduler's statistics."""

from __future__ import annotations

import attrs

from ..scheduler import PoolStatistics, SchedulerStatistics


@attrs.frozen(kw_only=True)
class RuntimeStatistics:
    """What a runtime has done, read on its engine thread."""

    #: The block pool now.
    pool: PoolStatistics
    #: Engine steps run (each advances every running sequence by one token).
    batches: int
    #: Largest number of sequences decoded in one step.
    max_batch_size: int
    #: Prompt tokens run through the model.
    prefill_tokens: int
    #: Tokens generated.
    generated_tokens: int
    #: History tokens reused from caches instead of prefilled again.
    cached_tokens: int
    #: Turns finished.
    turns: int
    #: Turns queued or running now.
    turns_in_flight: int
    #: Live agents.
    agents: int
    #: Agents whose cache is in the pool.
    resident_agents: int
    #: Distinct blocks those agents hold (a block several agents share counts once).
    resident_blocks: int
    #: Of those, blocks held by more than one agent.
    shared_blocks: int
    #: Bytes that sharing saves: what the agents' blocks would take if none were
    #: shared, less what they take.
    shared_bytes: int
    #: History tokens taken from blocks other agents' turns computed.
    shared_tokens: int
    #: Agents whose cache was moved to disk to make room.
    agents_on_disk: int
    #: Caches moved to disk, and brought back, so far.
    evictions: int
    restores: int
    #: Of ``restores``, those taken from host memory (``host_bytes``), not the files.
    memory_restores: int = 0
    #: Of ``restores``, those made ahead of the agent's turn, while other turns ran (it
    #: was expected to be asked next).
    prefetches: int = 0
    #: Bytes of evicted caches, and of host copies of blocks in the pool, kept in host
    #: memory now (at most ``host_bytes``).
    host_bytes: int = 0


def runtime_statistics(s: SchedulerStatistics, *, agents: int) -> RuntimeStatistics:
    """A runtime's statistics from its scheduler's, with its count of live ``agents``."""
    return RuntimeStatistics(
        pool=s.pool,
        batches=s.engine.steps,
        max_batch_size=s.engine.max_decode_batch,
        prefill_tokens=s.engine.prefill_tokens,
        generated_tokens=s.engine.generated_tokens,
        cached_tokens=s.engine.cached_tokens,
        turns=s.engine.completed,
        turns_in_flight=s.turns_in_flight,
        agents=agents,
        resident_agents=s.resident_agents,
        resident_blocks=s.resident_blocks,
        shared_blocks=s.shared_blocks,
        shared_bytes=s.shared_bytes,
        shared_tokens=s.engine.shared_tokens,
        agents_on_disk=s.agents_on_disk,
        evictions=s.evictions,
        restores=s.restores,
        memory_restores=s.memory_restores,
        prefetches=s.prefetches,
        host_bytes=s.host_bytes,
    )
