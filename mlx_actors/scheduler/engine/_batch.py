"""The sequences decoding now: those in mlx-lm's ``BatchGenerator`` and the one that
decodes alone beside it (:class:`Solo`). Owns how a planned sequence starts (on its
agent's kept cache, on its source blocks, or on a prefill job's cache), the model work of
one step for them, and turning what that step produced into tokens and finished caches."""

from __future__ import annotations

import copy
import time
from collections.abc import Hashable
from typing import Any

import attrs
from mlx.nn.layers.base import Module
from mlx_lm.generate import BatchGenerator

from ..caches import _attention
from ..kv._blocks import make_cache, over_blocks, to_cache
from ..kv._spec import BLOCK_SIZE, ModelCacheSpec
from ._buffers import keeping
from ._output import Output
from ._pacing import Pacing
from ._prefill import snapshot
from ._records import CompletedGeneration, FinishReason
from ._sequence import EngineSequence, SequenceState
from ._solo import KeptCaches, Solo


@attrs.define
class Advance:
    """What the model work of one step produced, before it becomes tokens."""

    #: When the work began (``time.perf_counter()``).
    began: float
    #: The generator's prompt progress and decoded tokens.
    prompts: list[Any]
    responses: list[Any]
    #: The lone sequence's sampled token and why it ended, if it decoded.
    solo: tuple[EngineSequence, Solo, int, str | None] | None
    #: Prompt tokens run, and the agents whose prompts ran.
    prefill: int
    prefilled: list[str]


class Batch:
    """The running sequences: mlx-lm's ``BatchGenerator`` and a lone one beside it.

    A sequence started while nothing else runs decodes alone (:class:`Solo`, mlx-lm's
    ``generate_step`` path: its cache updated in place, from its agent's kept cache when
    there is one); the next one to start hands it over to the generator, which decodes
    every other sequence as one batch.

    Args:
        model: the mlx-lm model.
        spec: its cache spec.
        output: where tokens are emitted and finished caches cut into blocks.
        kept_caches: caches of lone sequences kept for their agents' next turns.
        pacing: the prefill rate, recorded as prompts run.
        eos: the tokens that end a sequence.
        paged: sequences in the batch read their histories from the blocks.
        decode_kernel: decoding rows attend through the batch cache where it can (on
            a CUDA GPU, the decode kernel); ``False``: mlx-lm's masked attention.
        prefill_step_size: most prompt tokens per sequence in one generator step.
        generator_options: the ``BatchGenerator``'s keyword arguments.
    """

    def __init__(
        self,
        model: Module,
        spec: ModelCacheSpec,
        output: Output,
        kept_caches: KeptCaches,
        pacing: Pacing,
        eos: frozenset[int],
        *,
        paged: bool = False,
        decode_kernel: bool = True,
        prefill_step_size: int,
        generator_options: dict[str, Any],
    ) -> None:
        self.model = model
        self.spec = spec
        self.output = output
        self.kept_caches = kept_caches
        self.pacing = pacing
        self._eos = eos
        self._paged = paged
        self._decode_kernel = decode_kernel
        self._prefill_step_size = prefill_step_size
        self._generator_options = generator_options
        self._generator = BatchGenerator(model, **generator_options)
        #: The generator's sequences, by its uid.
        self.running: dict[int, EngineSequence] = {}
        #: The sequence decoding alone, and how.
        self.solo: tuple[EngineSequence, Solo] | None = None
        #: Finished while being handed to the generator, this step.
        self.done: list[CompletedGeneration] = []
        self.solo_tokens = self.hot_starts = 0

    @property
    def busy(self) -> bool:
        """Whether any sequence decodes."""
        return bool(self.running) or self.solo is not None

    @property
    def stream(self) -> Any:
        """The stream the model runs on."""
        return self._generator.stream

    # -- starting -----------------------------------------------------------------------

    def insert(
        self,
        seq: EngineSequence,
        cache: list[Any] | None,
        start: int = 0,
        gathered: dict[Hashable, list[Any]] | None = None,
    ) -> None:
        """Start ``seq``: with ``cache`` (a prefill job's, holding its first ``start``
        tokens), else with a cache built from its source blocks (``gathered``: the
        histories gathered for the sequences started with it, see :meth:`_history`).
        Alone, it decodes outside the batch (:class:`Solo`); else in the batch, which a
        sequence decoding alone joins first."""
        alone = not self.busy
        if cache is None:
            start = seq.source.length
            if start and (alone or not self._paged):  # alone it runs on it in place;
                cache = self.kept(seq, start)  # joining, the batch copies it (no gather)
            else:  # the batch reads the blocks: a kept copy would only be copied again
                self.kept_caches.drop(seq.agent_id)
        if cache is None and start and not alone and self._paged:  # the blocks, as they are
            cache = to_cache(self.spec, seq.source.layers, start, paged=True)
        elif cache is None and seq.seed is not None and seq.seed[0].offset == start:
            cache = snapshot(seq.seed)
        elif cache is None and start:
            # Alone, the cache is updated in place: room for the prompt and a block of
            # reply saves copying it all again at the first update.
            room = len(seq.tokens) - start + BLOCK_SIZE if alone else 0
            cache = self._history(seq, start, room, gathered)
        seq.seed = None
        if seq.source.length > seq.kept:  # a prefix computed for others: keep its state
            seq.anchors = (*seq.anchors, seq.source.length)
        prompt = seq.tokens[start:]
        if alone:
            run = Solo(
                self.model,
                cache if cache is not None else make_cache(self.spec),
                prompt,
                sampler=seq.sampler,
                budget=seq.budget,
                eos=self._eos,
                stream=self.stream,
                processors=seq.processors,
                context=seq.tokens[:-1],
            )
            seq.state, self.solo = SequenceState.SOLO, (seq, run)
            return
        if self.solo is not None:
            self._hand_over()
        self._join(seq, prompt, cache, seq.budget)

    def _history(
        self,
        seq: EngineSequence,
        start: int,
        room: int,
        gathered: dict[Hashable, list[Any]] | None,
    ) -> list[Any]:
        """``seq``'s first ``start`` tokens as a cache, from its source blocks. Sequences
        started together on the same pieces of the same blocks (a fan-out on one brief,
        sessions on one prefix) share one gather: each gets cache objects of its own over
        the same arrays, which the batch's merge only reads (a cache with ``room`` is
        updated in place: its own copy)."""
        if room or gathered is None:
            return to_cache(self.spec, seq.source.layers, start, room=room)
        key = (start, tuple(tuple((b.id, a, z) for b, a, z in x) for x in seq.source.layers))
        model = gathered.get(key)
        if model is None:
            model = gathered[key] = to_cache(self.spec, seq.source.layers, start)
        return [copy.copy(layer) for layer in model]

    def kept(self, seq: EngineSequence, start: int) -> list[Any] | None:
        """``seq``'s agent's kept cache, cut back to ``start`` tokens, if it serves
        (counted as a hot start)."""
        cache = self.kept_caches.take(seq.agent_id, seq.tokens, start)
        self.hot_starts += cache is not None
        return cache

    def _join(
        self,
        seq: EngineSequence,
        prompt: list[int],
        cache: list[Any] | None,
        budget: int,
        *,
        generated: bool = False,
    ) -> None:
        """Insert ``seq`` into the ``BatchGenerator`` with ``prompt`` on ``cache``; a
        ``generated`` prompt (the token a lone sequence sampled) is not counted as
        prefilled."""
        seq.prompting, seq.prompt = len(prompt) > 1, len(prompt)
        seq.prefilled = len(prompt) if generated else 0
        if cache is None:
            cache = make_cache(self.spec)
        if self._paged:  # a paged batch's row: its history read from the blocks
            cache = over_blocks(self.spec, seq.source.layers, seq.source.length, cache)
        context = None
        if seq.processors:  # they read the whole sequence: the tokens before the prompt too
            done = [*seq.tokens, *seq.generated]
            context = [done[: len(done) - len(prompt)]]
        (gen_uid,) = self._generator.insert(
            [prompt],
            max_tokens=[budget],
            caches=[cache],
            all_tokens=context,
            samplers=[seq.sampler] if seq.sampler is not None else None,
            logits_processors=[seq.processors] if seq.processors else None,
        )
        seq.state, seq.gen_uid = SequenceState.RUNNING, gen_uid
        self.running[gen_uid] = seq

    def _hand_over(self) -> None:
        """Move the sequence decoding alone into the batch: it emits the token it has
        sampled, and joins with that token as its prompt, on its cache (or finishes)."""
        assert self.solo is not None
        (seq, run), self.solo = self.solo, None
        if not run.started:
            self._join(seq, run.prompt[run.done :], run.cache, seq.budget)
            return
        token, ended = run.next(go_on=False)
        self.solo_tokens += 1
        reason = self.output.emit(seq, token, ended, time.perf_counter(), run.logprobs)
        if reason is not None:
            self.done.append(self._finish(seq, run.settle(), reason))
        else:
            self._join(seq, [token], run.cache, seq.budget - len(seq.generated), generated=True)

    # -- a step -------------------------------------------------------------------------

    def advance(self, budget: int) -> Advance:
        """The model work of one step: a step of the generator (its prompts' chunks
        sized so that together they run about ``budget`` tokens), and the lone
        sequence's prefill chunk or next token."""
        work = Advance(time.perf_counter(), [], [], None, 0, [])
        if self.running:
            left = [s.prompt - 1 - s.prefilled for s in self.running.values() if s.prompting]
            if left and max(left) <= self._prefill_step_size and sum(left) <= budget:
                # All of them fit: whole, so that turns started together start decoding
                # together.
                self._generator.prefill_step_size = self._prefill_step_size
            elif left:
                share = max(1, budget // len(left))
                share = 1 << (share.bit_length() - 1)  # few distinct shapes (see Pacing)
                self._generator.prefill_step_size = min(self._prefill_step_size, share)
            # mlx-lm would empty MLX's buffer cache (see _buffers)
            with keeping(), _attention.masked(not self._decode_kernel):
                work.prompts, work.responses = self._generator.next()
        if self.solo is not None:
            seq, run = self.solo
            if not run.prefilled:
                work.prefilled.append(seq.agent_id)
                began = time.perf_counter()
                ran = run.prefill(budget)
                self.pacing.record(ran, time.perf_counter() - began)
                work.prefill += ran
            if run.prefilled and not run.started:
                run.begin()
                work.prefill += 1  # the last prompt token, as the generator counts it
            if run.started:
                work.solo = (seq, run, *run.next())
        return work

    def collect(self, work: Advance, now: float) -> tuple[list[CompletedGeneration], list[str]]:
        """Emit what ``work`` decoded; return the sequences that finished (with those
        finished while handed over) and the agents that decoded a token. Adds the
        generator's prompt tokens to ``work``."""
        prompted_tokens = 0
        for pr in work.prompts:
            prompted = self.running.get(pr.uid)
            if prompted is not None:
                work.prefilled.append(prompted.agent_id)
                done = int(pr.progress[0])
                prompted_tokens += max(0, done - prompted.prefilled)
                prompted.prefilled = max(done, prompted.prefilled)
                prompted.prompting = not pr.end_of_prompt
        if prompted_tokens and not work.responses:  # nothing decoded: the step was prefill
            self.pacing.record(prompted_tokens, now - work.began)
        work.prefill += prompted_tokens
        finished, self.done = self.done, []
        stopped: list[EngineSequence] = []
        decoded = [self.running[r.uid].agent_id for r in work.responses]
        for r in work.responses:
            seq = self.running[r.uid]
            reason = self.output.emit(seq, r.token, r.finish_reason, now, r.logprobs)
            if r.finish_reason is not None:
                finished.append(self._finish(seq, r.prompt_cache, reason or r.finish_reason))
            elif reason is not None:
                stopped.append(seq)
        if stopped:
            gen_uids = [s.gen_uid for s in stopped]
            caches = self._generator.remove(gen_uids, return_prompt_caches=True)
            finished.extend(self._finish(s, caches[s.gen_uid][0], "stop") for s in stopped)
        if work.solo is not None:
            seq, run, token, why = work.solo
            decoded.append(seq.agent_id)
            self.solo_tokens += 1
            reason = self.output.emit(seq, token, why, now, run.logprobs)
            if reason is not None:
                self.solo = None
                finished.append(self._finish(seq, run.settle(), reason))
        return finished, decoded

    def _finish(
        self, seq: EngineSequence, cache: list[Any], reason: FinishReason
    ) -> CompletedGeneration:
        if seq.gen_uid is not None:
            del self.running[seq.gen_uid]
        return self.output.finish(seq, cache, reason)

    # -- ending -------------------------------------------------------------------------

    def remove(self, seq: EngineSequence) -> None:
        """Drop a running or lone sequence (cancelled)."""
        if seq.state is SequenceState.RUNNING:
            assert seq.gen_uid is not None
            del self.running[seq.gen_uid]
            self._generator.remove([seq.gen_uid])
        elif seq.state is SequenceState.SOLO:
            self.solo = None

    def reset(self) -> None:
        """Drop every running sequence and start a new generator (after a failed step)."""
        self.running.clear()
        self.solo, self.done = None, []
        self.kept_caches.drop()
        self._generator.close()
        self._generator = BatchGenerator(self.model, **self._generator_options)

    def close(self) -> None:
        """Release the generator."""
        self._generator.close()
