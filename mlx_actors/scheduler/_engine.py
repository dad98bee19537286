"""The batch engine: every sequence runs through one mlx-lm ``BatchGenerator``, and each
sequence's cache lives as blocks of a :class:`BlockPool` between turns."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import apply_top_p

from ..errors import EngineError, InvalidRequestError
from ._blocks import blocks_needed, check_blocks, evaluate, from_cache, max_trim, to_cache
from ._pool import AgentBlocks, BlockPool, Reservation
from ._spec import ModelCacheSpec
from ._text import TextStream

FinishReason = Literal["stop", "length"]
Sampler = Callable[[mx.array], mx.array]


@attrs.frozen(kw_only=True)
class Sampling:
    """How the next token is chosen."""

    #: 0 picks the most likely token (greedy, the default); higher flattens the choice.
    temperature: float = 0.0
    #: Nucleus sampling: keep the most likely tokens whose mass reaches ``top_p``.
    top_p: float = 1.0
    #: Seed of this sequence's own random stream; ``None`` picks one at random.
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidRequestError(f"seed must be an int or None, got {self.seed!r}")

    def make_sampler(self) -> Sampler | None:
        """A sampler with its own random key, or ``None`` for greedy decoding."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        key = [mx.random.key(seed)]
        inv_temp, top_p = 1.0 / self.temperature, self.top_p

        def sample(logprobs: mx.array) -> mx.array:
            key[0], sub = mx.random.split(key[0])
            if top_p < 1.0:
                logprobs = apply_top_p(logprobs, top_p)
            return mx.random.categorical(logprobs * inv_temp, key=sub)

        return sample


@attrs.frozen(kw_only=True)
class Usage:
    """Tokens one turn cost."""

    #: New tokens run through the model before generating (the prefill).
    prompt_tokens: int
    #: History tokens taken from the cache instead of being prefilled again.
    cached_tokens: int
    #: Tokens generated.
    generated_tokens: int


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token, as it comes."""

    uid: int
    token: int
    #: Text that became printable with this token (may be empty; never half a character).
    text: str


@attrs.frozen(kw_only=True)
class CompletedGeneration:
    """A finished sequence: what it generated and its cache, as new blocks."""

    uid: int
    agent_id: str
    #: Generated token ids (a final end-of-sequence token included).
    tokens: tuple[int, ...]
    #: The generated text, without the end-of-sequence token or a matched stop string.
    text: str
    finish_reason: FinishReason
    #: The whole history's cache (earlier turns, prompt, reply). The caller owns it.
    blocks: AgentBlocks
    usage: Usage
    #: When the sequence was submitted (``time.perf_counter()``).
    submitted_at: float
    #: Seconds from submission to the first generated token.
    ttft_s: float
    #: Seconds from submission to the end.
    total_s: float


@attrs.frozen(kw_only=True)
class StepInfo:
    """What one :meth:`BlockPoolBatchEngine.step` did."""

    #: Sequences that produced a token this step.
    decode_batch: int
    #: Prompt tokens run through the model this step.
    prefill_tokens: int
    #: Sequences that finished this step.
    finished: int
    #: Wall time of the step.
    seconds: float


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """Totals since the engine started."""

    #: Calls of :meth:`BlockPoolBatchEngine.step` that ran the model.
    steps: int
    #: Prompt tokens prefilled.
    prefill_tokens: int
    #: Tokens generated.
    generated_tokens: int
    #: History tokens reused from caches instead of prefilled.
    cached_tokens: int
    #: Sequences finished.
    completed: int
    #: Largest decode batch seen.
    max_decode_batch: int


@attrs.define(eq=False)
class _Sequence:
    uid: int
    agent_id: str
    previous: AgentBlocks | None
    history: tuple[int, ...]
    prompt: list[int]
    reservation: Reservation
    text: TextStream
    on_token: Callable[[TokenEvent], None] | None
    submitted: float
    generated: list[int] = attrs.Factory(list)
    prefilled: int = 0
    first_token: float | None = None


class BlockPoolBatchEngine:
    """Runs many sequences through one ``BatchGenerator``; keeps their caches as blocks.

    A sequence is submitted with token ids (or text) and, to continue an earlier turn,
    the :class:`AgentBlocks` that turn returned: its prompt is then only the new
    tokens. :meth:`step` advances every sequence by one token and returns those that
    finished, each with a new ``AgentBlocks``. Blocks become an mlx-lm cache once, on
    :meth:`submit`, and the finished cache becomes blocks once, on finish.

    Not thread-safe: make every call from the one thread that owns the model.

    Args:
        model: an mlx-lm model.
        tokenizer: its mlx-lm ``TokenizerWrapper``.
        pool: the pool the caches live in.
        spec: the model's cache spec (the pool's, by default).
        max_batch_size: most sequences decoded together; more wait in a queue.
        prefill_batch_size: most prompts prefilled together.
        prefill_step_size: most prompt tokens per sequence run in one step, so a long
            prompt does not stall the sequences already decoding.
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
    ) -> None:
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("prefill_batch_size", prefill_batch_size),
            ("prefill_step_size", prefill_step_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.spec = spec if spec is not None else pool.spec
        if self.spec != pool.spec:
            raise InvalidRequestError("the pool was made for another model's cache spec")
        self.max_batch_size = max_batch_size
        self._generator_options = dict(
            completion_batch_size=max_batch_size,
            prefill_batch_size=min(prefill_batch_size, max_batch_size),
            prefill_step_size=prefill_step_size,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        )
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._vocab_size = _vocab_size(model, tokenizer)
        self._generator = BatchGenerator(model, **self._generator_options)
        self._sequences: dict[int, _Sequence] = {}
        self._steps = self._prefill_tokens = self._generated_tokens = 0
        self._cached_tokens = self._completed = self._max_decode_batch = 0
        self.last_step: StepInfo | None = None

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
    ) -> int:
        """Queue a sequence; it joins the batch at the next :meth:`step`.

        Args:
            agent_id: who the sequence belongs to (carried to the result).
            prompt: the new token ids, or text to encode. With ``cache``, only the
                tokens that follow the cached history.
            cache: blocks from an earlier turn of this agent, or ``None``.
            trim: drop this many tokens from the end of ``cache`` first (when the
                history was rewritten). The cache itself is not changed.
            max_tokens: most tokens to generate; fewer if the model's context ends.
            sampling: temperature, top-p and seed; greedy by default.
            stop: strings that end the generation; the match is not part of the text.
            on_token: called on this thread with each :class:`TokenEvent`.

        Returns:
            The sequence's uid.

        Raises:
            InvalidRequestError: empty prompt, token ids outside the vocabulary,
                ``max_tokens <= 0``, a bad ``trim``, a prompt longer than the model's
                context or than the whole pool.
            CacheReconstructionError: ``cache`` does not fit this model or was freed.
            PoolExhaustedError: the pool has too few free blocks right now.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be an int > 0, got {max_tokens!r}")
        sampling = sampling if sampling is not None else Sampling()
        stops = _check_stops(stop)
        if cache is not None:
            check_blocks(self.pool, cache)
            if cache.num_tokens == 0:
                cache = None
        history_len = cache.num_tokens if cache is not None else 0
        if isinstance(trim, bool) or not isinstance(trim, int) or not 0 <= trim <= history_len:
            raise InvalidRequestError(
                f"trim must be an int in [0, {history_len}] (the cached tokens), got {trim!r}"
            )
        if cache is not None and trim > max_trim(self.spec, cache):
            raise InvalidRequestError(
                f"cannot trim {trim} tokens: sliding-window layers no longer hold the "
                f"tokens that would need (at most {max_trim(self.spec, cache)}); submit "
                "the whole history without a cache instead"
            )
        kept = history_len - trim
        tokens = self._encode(prompt, fresh=kept == 0)
        total = kept + len(tokens)
        limit = self.spec.context_length
        if limit is not None and total >= limit:
            raise InvalidRequestError(
                f"the prompt ({len(tokens)} new + {kept} cached tokens) leaves no room in "
                f"the model's context of {limit} tokens; shorten the conversation"
            )
        budget = min(max_tokens, limit - total) if limit is not None else max_tokens
        need = blocks_needed(self.spec, total + budget, kept if cache is not None else 0)
        if need > self.pool.total_blocks:
            raise InvalidRequestError(
                f"the turn may need {need} blocks ({total} prompt tokens + {budget} new), "
                f"more than the whole pool of {self.pool.total_blocks}; lower max_tokens, "
                "shorten the conversation or give the runtime a larger pool"
            )
        reservation = self.pool.reserve(need)
        try:
            caches = None
            history: tuple[int, ...] = ()
            if cache is not None and kept > 0:
                caches = [to_cache(self.spec, cache, kept)]
                history = cache.tokens[:kept]
            sampler = sampling.make_sampler()
            (uid,) = self._generator.insert(
                [tokens],
                max_tokens=[budget],
                caches=caches,
                samplers=[sampler] if sampler is not None else None,
            )
        except BaseException:
            reservation.release()
            raise
        self._sequences[uid] = _Sequence(
            uid=uid,
            agent_id=agent_id,
            previous=cache if kept > 0 else None,
            history=history,
            prompt=tokens,
            reservation=reservation,
            text=TextStream(self.tokenizer.detokenizer, stops),
            on_token=on_token,
            submitted=time.perf_counter(),
        )
        return int(uid)

    def _encode(self, prompt: Sequence[int] | str, *, fresh: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            tokens = list(self.tokenizer.encode(prompt, add_special_tokens=fresh))
        else:
            try:
                tokens = [int(t) for t in prompt]
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    "the prompt must be text or a sequence of token ids"
                ) from exc
            if any(isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("token ids must be ints, not bools")
        if not tokens:
            raise InvalidRequestError("the prompt has no tokens")
        bad = [t for t in tokens if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})"
            )
        return tokens

    # -- running ----------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Sequences submitted and not yet finished or cancelled."""
        return len(self._sequences)

    def step(self) -> list[CompletedGeneration]:
        """Advance the batch by one step and return the sequences that finished.

        Raises:
            EngineError: the model step failed. Every sequence in flight was dropped and
                its reservation returned (their uids are in ``error.uids``); the engine
                is ready for new work.
        """
        if not self._sequences:
            self.last_step = None
            return []
        started = time.perf_counter()
        try:
            prompt_responses, responses = self._generator.next()
        except Exception as exc:
            uids = self._reset()
            raise EngineError(
                f"the model step failed ({exc!r}); {len(uids)} sequences were dropped",
                uids=uids,
            ) from exc
        now = time.perf_counter()
        prefill = 0
        for pr in prompt_responses:
            seq = self._sequences.get(pr.uid)
            if seq is not None:
                done = int(pr.progress[0])
                prefill += done - seq.prefilled
                seq.prefilled = done
        finished: list[CompletedGeneration] = []
        stopped: list[_Sequence] = []
        for r in responses:
            seq = self._sequences[r.uid]
            seq.generated.append(r.token)
            if seq.first_token is None:
                seq.first_token = now
            reason: FinishReason | None = r.finish_reason
            piece, matched = seq.text.add(r.token, eos=reason == "stop" and r.token in self._eos)
            if matched:
                if reason is None:
                    stopped.append(seq)
                reason = "stop"
            if reason is not None:
                piece += seq.text.finish()
            if seq.on_token is not None:
                seq.on_token(TokenEvent(uid=r.uid, token=r.token, text=piece))
            if r.finish_reason is not None:
                finished.append(self._finish(seq, r.prompt_cache, reason or r.finish_reason))
        if stopped:
            caches = self._generator.remove([s.uid for s in stopped], return_prompt_caches=True)
            finished.extend(self._finish(s, caches[s.uid][0], "stop") for s in stopped)
        if finished:  # one evaluation (one wait for the device) for every finished cache
            evaluate([f.blocks for f in finished])
        self._steps += 1
        self._prefill_tokens += prefill
        self._generated_tokens += len(responses)
        self._max_decode_batch = max(self._max_decode_batch, len(responses))
        self.last_step = StepInfo(
            decode_batch=len(responses),
            prefill_tokens=prefill,
            finished=len(finished),
            seconds=time.perf_counter() - started,
        )
        return finished

    def _finish(
        self, seq: _Sequence, cache: list[Any], reason: FinishReason
    ) -> CompletedGeneration:
        del self._sequences[seq.uid]
        tokens = (*seq.history, *seq.prompt, *seq.generated)
        try:
            blocks = from_cache(
                self.pool, cache, tokens, seq.reservation, seq.previous, len(seq.history)
            )
        finally:
            seq.reservation.release()
        now = time.perf_counter()
        self._completed += 1
        self._cached_tokens += len(seq.history)
        return CompletedGeneration(
            uid=seq.uid,
            agent_id=seq.agent_id,
            tokens=tuple(seq.generated),
            text=seq.text.text,
            finish_reason=reason,
            blocks=blocks,
            usage=Usage(
                prompt_tokens=len(seq.prompt),
                cached_tokens=len(seq.history),
                generated_tokens=len(seq.generated),
            ),
            submitted_at=seq.submitted,
            ttft_s=(seq.first_token or now) - seq.submitted,
            total_s=now - seq.submitted,
        )

    def cancel(self, uid: int) -> bool:
        """Drop a queued or running sequence and return its reserved blocks.

        Returns whether ``uid`` was in flight. The blocks it was submitted with are
        untouched: they still belong to the caller.
        """
        seq = self._sequences.pop(uid, None)
        if seq is None:
            return False
        self._generator.remove([uid])
        seq.reservation.release()
        return True

    def release(self, blocks: AgentBlocks | None) -> None:
        """Give an ``AgentBlocks``'s references back to the pool."""
        if blocks is not None:
            self.pool.free(blocks.blocks())

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            steps=self._steps,
            prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated_tokens,
            cached_tokens=self._cached_tokens,
            completed=self._completed,
            max_decode_batch=self._max_decode_batch,
        )

    def _reset(self) -> list[int]:
        uids = list(self._sequences)
        for seq in self._sequences.values():
            seq.reservation.release()
        self._sequences.clear()
        self._generator.close()
        self._generator = BatchGenerator(self.model, **self._generator_options)
        return uids

    def close(self) -> None:
        """Cancel everything in flight and release the generator."""
        self._reset()
        self._generator.close()


def _check_stops(stop: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    stops = tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(f"stop must be a sequence of non-empty strings, got {stop!r}")
    return stops


def _vocab_size(model: Module, tokenizer: Any) -> int:
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tokenizer)
