"""The batch engine: every sequence runs through one mlx-lm ``BatchGenerator``, and each
sequence's cache lives as blocks of a :class:`BlockPool` between turns, indexed by the
tokens they hold so that any sequence starts from the longest prefix any agent computed."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from ...errors import (
    EngineError,
    InvalidRequestError,
    MlxActorsError,
)
from ..caches import _attention
from ..kv._blocks import (
    evaluate,
    make_cache,
)
from ..kv._pool import AgentBlocks, BlockPool
from ..kv._prefix import PrefixIndex
from ..kv._spec import ModelCacheSpec
from . import _buffers
from ._batch import Batch
from ._intake import Intake
from ._output import Output
from ._pacing import Pacing
from ._planner import Planner
from ._records import (
    Admission,
    CompletedGeneration,
    EngineStatistics,
    LogitsProcessor,
    Sampling,
    StepInfo,
    TokenEvent,
)
from ._sequence import EngineSequence, SequenceState
from ._solo import KeptCaches, kept_for
from ._starting import Starter

_AUTO: Any = object()


class BlockPoolBatchEngine:
    """Runs many sequences through one ``BatchGenerator``; keeps their caches as blocks.

    A sequence is submitted with token ids (or text) and, to continue an earlier turn,
    the :class:`AgentBlocks` that turn returned: its prompt is then only the new
    tokens. :meth:`step` advances every sequence by one token and returns those that
    finished, each with a new ``AgentBlocks``. Every live block is indexed by the
    tokens it was computed from (:class:`PrefixIndex`): a sequence starts from the
    longest prefix of its tokens that any live blocks hold (its own earlier turns', or
    with ``share_prefixes`` any agent's), and a finished cache is cut into blocks that
    reuse what exists, so a prefix shared by many agents is held once.

    A long prompt, or any prompt on a long cached history, is prefilled as a job
    (:class:`PrefillJob`): one sequence at a time, unpadded, as mlx-lm's own
    ``generate_step`` prefills, outside the ``BatchGenerator`` (whose batched prefill
    pads and copies every cache in the batch); the sequence then joins the batch with
    its last prompt token. With ``share_prefixes``, sequences submitted together that
    share a prefix of at least ``min_shared`` tokens do not each prefill it: the first
    one's prefill runs as a job, which stops where the others' prompts diverge from it
    and publishes its cache there as blocks; the others wait for that and start from
    them. A sequence arriving while such a job runs joins it the same way.

    Not thread-safe: make every call from the one thread that owns the model.

    Args:
        model: an mlx-lm model.
        tokenizer: its mlx-lm ``TokenizerWrapper``.
        pool: the pool the caches live in.
        spec: the model's cache spec (the pool's, by default).
        max_batch_size: most sequences decoded together; more wait in a queue.
        prefill_batch_size: prefill chunks run in one step, at most (of prefill jobs, or
            of prompts in the batch).
        prefill_step_size: most prompt tokens per sequence run in one step, so a long
            prompt does not stall the sequences already decoding.
        share_prefixes: reuse blocks across agents (namespaces), and run shared
            prefixes once; with ``False`` a sequence reuses only its own namespace's.
        min_shared: the shortest shared prefix worth waiting for.
        long_prefill: new prompt tokens (or, without ``paged_batch``, cached history
            tokens) from which a prefill runs as a job.
        paged_batch: decoding sequences read their histories' global layers from the
            pool's blocks, put together a layer at a time as attention needs them,
            instead of holding a copy in the batch's cache
            (:class:`~..caches._paged.PagedBatchKVCache`).
        decode_kernel: on a CUDA GPU, a batch's decode step attends over each row's
            own span with the project's kernel (:mod:`~..caches._decode_kernel`: each
            row's attention is MLX's on that row alone, bit for bit); ``False``:
            mlx-lm's attention with the padding mask, as its ``BatchGenerator`` runs it,
            so that every step's logits are raw ``BatchGenerator``'s bit for bit.
            Nothing changes elsewhere (no kernel runs there).
        step_seconds: how long one step's prefill should take, at most: the prompt
            tokens a step runs follow the prefill rate measured (:class:`Pacing`), so
            that cancels, timeouts and new turns wait for a short step on any machine.
        index: the prefix index of ``pool``'s blocks, told of each block the pool
            releases (by default one of the engine's own, subscribed to ``pool``).
        kept_caches: where caches of lone turns are kept for their agents' next ones
            (by default counted in the pool's budget, in the units it has free).
        make_room: called with an agent id when a reservation fails and no kept cache
            is left to give its units back; returns whether it freed blocks (by moving
            an idle agent's cache out of the pool), so that the engine tries again.
    """

    def __init__(
        self,
        model: Module,
        tokenizer: Any,
        pool: BlockPool,
        spec: ModelCacheSpec | None = None,
        *,
        max_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 512,
        share_prefixes: bool = True,
        min_shared: int = 64,
        long_prefill: int = 1024,
        paged_batch: bool = False,
        decode_kernel: bool = True,
        step_seconds: float = 0.25,
        index: PrefixIndex | None = None,
        kept_caches: KeptCaches | None = None,
        make_room: Callable[[str], bool] | None = None,
    ) -> None:
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("prefill_batch_size", prefill_batch_size),
            ("prefill_step_size", prefill_step_size),
            ("min_shared", min_shared),
            ("long_prefill", long_prefill),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
        if (
            isinstance(step_seconds, bool)
            or not isinstance(step_seconds, (int, float))
            or not 0 < step_seconds < float("inf")
        ):
            raise InvalidRequestError(f"step_seconds must be seconds > 0, got {step_seconds!r}")
        self.model = model
        _attention.install(model)  # batch caches' decode attention (a CUDA kernel)
        self.tokenizer = tokenizer
        self.pool = pool
        self.spec = spec if spec is not None else pool.spec
        if self.spec != pool.spec:
            raise InvalidRequestError("the pool was made for another model's cache spec")
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = min(prefill_batch_size, max_batch_size)
        self.prefill_step_size = prefill_step_size
        self.share_prefixes = share_prefixes
        self.min_shared = min_shared
        self.long_prefill = long_prefill
        self.paged_batch = paged_batch
        self.pacing = Pacing(
            step_seconds, ceiling=max(prefill_step_size, 2048) * prefill_batch_size
        )
        if index is None:  # an engine of its own: the pool tells its index of releases
            index = PrefixIndex(self.spec)
            pool.on_release(index.detach)
        self.index = index
        #: Caches of sequences that finished alone, for their agents' next turns.
        self._kept_caches = kept_caches if kept_caches is not None else kept_for(pool)

        def room(agent: str) -> bool:  # kept caches make way first, then idle agents
            if self._kept_caches.make_way(agent):
                return True
            return make_room is not None and make_room(agent)

        self.planner = Planner(
            self.spec,
            pool,
            index,
            share_prefixes=share_prefixes,
            min_shared=min_shared,
            make_room=room,
        )
        eos = frozenset(tokenizer.eos_token_ids)
        #: The width of the model's logits (token ids it can read and produce).
        self.vocab_size = _vocab_size(model, tokenizer)
        self._intake = Intake(self.spec, pool, tokenizer, self.vocab_size)
        self._uids = itertools.count()
        self._sequences: dict[int, EngineSequence] = {}
        self.output = Output(self.spec, pool, index, self._kept_caches, eos)
        self.batch = Batch(
            model,
            self.spec,
            self.output,
            self._kept_caches,
            self.pacing,
            eos,
            paged=paged_batch,
            decode_kernel=decode_kernel,
            prefill_step_size=prefill_step_size,
            generator_options=dict(
                completion_batch_size=max_batch_size,
                # Long prompts and long histories are prefilled as jobs: what joins the
                # generator's own prompt batches is short, and each join copies every
                # cache of the running batch, so sequences ready together join in one.
                prefill_batch_size=max_batch_size,
                prefill_step_size=prefill_step_size,
                stop_tokens=[[t] for t in sorted(eos)],
            ),
        )
        self._refused: list[tuple[int, MlxActorsError]] = []
        self._starter = Starter(
            model,
            self.spec,
            pool,
            self.planner,
            self.batch,
            self.pacing,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=prefill_step_size,
            long_prefill=long_prefill,
            paged_batch=paged_batch,
            refuse=self._refuse,
        )
        self._steps = self._prefill_tokens = self._generated_tokens = 0
        self._max_decode_batch = 0
        self.last_step: StepInfo | None = None
        _buffers.hold()  # MLX's buffer cache limited, until close()
        self._holds_buffers = True

    # -- submitting -------------------------------------------------------------------

    def submit(
        self,
        agent_id: str,
        prompt: Sequence[int] | str,
        cache: AgentBlocks | None = None,
        *,
        trim: int = 0,
        max_tokens: int = 256,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        on_token: Callable[[TokenEvent], None] | None = None,
        namespace: Hashable = _AUTO,
        processors: Sequence[LogitsProcessor] = (),
    ) -> int:
        """Queue a sequence; it joins the batch at the next :meth:`step` (or waits there
        for a shared prefix another sequence is prefilling).

        Args:
            agent_id: who the sequence belongs to (carried to the result).
            prompt: the new token ids, or text to encode. With ``cache``, only the
                tokens that follow the cached history.
            cache: blocks from an earlier turn of this agent, or ``None``.
            trim: drop this many tokens from the end of ``cache`` first (when the
                history was rewritten). The cache itself is not changed.
            max_tokens: most tokens to generate; fewer if the model's context ends.
            sampling: how tokens are chosen (greedy by default), and whether their
                log-probabilities are recorded.
            stop: strings that end the generation; the match is not part of the text.
            on_token: called on this thread with each :class:`TokenEvent`.
            namespace: which blocks the sequence may reuse and share: those of its
                namespace only (default: every sequence's with ``share_prefixes``,
                else the agent's own).
            processors: more logits processors (after ``sampling``'s), as mlx-lm's
                ``generate_step`` takes them: called with the sequence's tokens so far
                (history, prompt and generated) and the next token's logits.

        Returns:
            The sequence's uid.

        Raises:
            InvalidRequestError: empty prompt, token ids outside the vocabulary,
                ``max_tokens <= 0``, a bad ``trim``, a prompt longer than the model's
                context or than the whole pool.
            CacheReconstructionError: ``cache`` does not fit this model or was freed.
            PoolExhaustedError: the pool has too few free blocks right now.
        """
        if namespace is _AUTO:
            namespace = None if self.share_prefixes else agent_id
        seq = self._intake.sequence(
            next(self._uids),
            agent_id,
            prompt,
            cache,
            trim=trim,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            on_token=on_token,
            namespace=namespace,
            processors=processors,
        )
        self.planner.plan(seq)
        self._sequences[seq.uid] = seq
        return seq.uid

    def admission(self, uid: int) -> Admission | None:
        """Where a submitted sequence starts (``None`` once it is no longer in flight)."""
        seq = self._sequences.get(uid)
        return seq.admission if seq is not None else None

    @property
    def active(self) -> int:
        """Sequences submitted and not yet finished or cancelled."""
        return len(self._sequences)

    def take_refused(self) -> list[tuple[int, MlxActorsError]]:
        """Sequences dropped since the last call because, waiting for a shared prefix,
        they could no longer get the blocks they need; each with its error."""
        refused, self._refused = self._refused, []
        return refused

    def step(self) -> list[CompletedGeneration]:
        """Advance the batch by one step and return the sequences that finished.

        A step starts the sequences that are ready, runs chunks of the prefill jobs
        within the step's prompt-token budget (:class:`~._starting.Starter`), and runs
        the batch's model work: one step of the ``BatchGenerator`` and the lone
        sequence's prefill chunk or next token.

        Raises:
            EngineError: the model step failed. Every sequence in flight was dropped and
                its reservation returned (their uids are in ``error.uids``); the engine
                is ready for new work.
        """
        if not self._sequences and not self.planner.jobs:
            self.last_step = None
            return []
        started = time.perf_counter()
        joined = len(self.batch.running)
        self.output.decoded = 0
        try:
            self._starter.start_pending()
            jobs, prefill = self._starter.run_jobs()
            jobs_done = time.perf_counter()
            joined = len(self.batch.running) - joined
            work = self.batch.advance(max(self.pacing.floor, self.pacing.budget() - prefill))
        except Exception as exc:
            uids = self._reset()
            raise EngineError(
                f"the model step failed ({exc!r}); {len(uids)} sequences were dropped",
                uids=uids,
            ) from exc
        finished, decoded = self.batch.collect(work, time.perf_counter())
        for done in finished:
            del self._sequences[done.uid]
        prefill += work.prefill
        # Agents whose prompts ran in the step: as prefill jobs, then in the batch.
        prefilled = [*self._starter.prefilled, *work.prefilled]
        if finished:  # one evaluation (one wait for the device) for every finished cache
            evaluate([f.blocks for f in finished])
        self._steps += 1
        self._prefill_tokens += prefill
        self._generated_tokens += self.output.decoded
        self._max_decode_batch = max(self._max_decode_batch, self.output.decoded)
        ended = time.perf_counter()
        self.last_step = StepInfo(
            decode_batch=self.output.decoded,
            prefill_tokens=prefill,
            finished=len(finished),
            seconds=ended - started,
            jobs=jobs,
            jobs_seconds=jobs_done - started,
            joined=joined,
            batch_seconds=ended - jobs_done,
            prefilled=tuple(dict.fromkeys(prefilled)),
            decoded=tuple(decoded),
        )
        return finished

    def _refuse(self, seq: EngineSequence, error: MlxActorsError) -> None:
        del self._sequences[seq.uid]
        seq.release(self.pool)
        self._refused.append((seq.uid, error))

    def cancel(self, uid: int) -> bool:
        """Drop a queued or running sequence and return its reserved blocks.

        Returns whether ``uid`` was in flight. The blocks it was submitted with are
        untouched: they still belong to the caller.
        """
        seq = self._sequences.pop(uid, None)
        if seq is None:
            return False
        if seq.state in (SequenceState.RUNNING, SequenceState.SOLO):
            self.batch.remove(seq)
        elif seq.state is SequenceState.PENDING:
            self.planner.pending.remove(seq)
        elif seq.state is SequenceState.PARKED:
            assert seq.waiting is not None
            job, _ = seq.waiting
            job.leave(seq)
            if job.orphaned and job in self.planner.jobs:
                self.planner.drop_job(job)
        elif seq.state is SequenceState.JOB:
            assert seq.job is not None
            seq.job.leave(seq)  # it goes on for the sequences that wait on it
            if seq.job.orphaned:
                self.planner.drop_job(seq.job)
        seq.release(self.pool)
        return True

    def share(self, blocks: AgentBlocks) -> AgentBlocks:
        """One more holder of ``blocks`` (a fork): every block gains a reference."""
        self.pool.share_all(blocks.blocks())
        return blocks

    def forget(self, agent_id: str) -> None:
        """Drop the cache kept for ``agent_id``'s next lone turn (the agent is gone, or
        starts over)."""
        self._kept_caches.drop(agent_id)

    def release(self, blocks: AgentBlocks | None) -> None:
        """Give an ``AgentBlocks``'s references back to the pool."""
        if blocks is not None:
            self.pool.free(blocks.blocks())

    def calibrate_pacing(self) -> int:
        """Measure this machine's prefill rate on a throwaway cache (:meth:`Pacing.calibrate`)
        so that the first turns are paced by it; returns the budget it gives."""

        def prefill(tokens: int) -> None:
            cache = make_cache(self.spec)
            self.model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])

        self.pacing.calibrate(prefill)
        return self.pacing.budget()

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            steps=self._steps,
            prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated_tokens,
            cached_tokens=self.output.cached_tokens,
            completed=self.output.completed,
            max_decode_batch=self._max_decode_batch,
            shared_tokens=self.output.shared_tokens,
            prefill_jobs=self.planner.prefill_jobs,
            checkpoints=self.planner.checkpoints,
            solo_tokens=self.batch.solo_tokens,
            hot_starts=self.batch.hot_starts,
        )

    def _reset(self) -> list[int]:
        uids = list(self._sequences)
        for seq in self._sequences.values():
            seq.release(self.pool)
        for job in self.planner.jobs:
            job.release(self.pool)
        self._sequences.clear()
        self.planner.pending.clear()
        self.planner.jobs.clear()
        self.batch.reset()
        return uids

    def close(self) -> None:
        """Cancel everything in flight and release the generator."""
        self._reset()
        self.batch.close()
        if self._holds_buffers:
            self._holds_buffers = False
            _buffers.release()


def _vocab_size(model: Module, tokenizer: Any) -> int:
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tokenizer)
