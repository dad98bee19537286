"""What goes into the batch engine and what comes out: sampling settings, usage, where a
sequence starts, streamed tokens, finished generations and statistics."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ...errors import InvalidRequestError
from ..kv._pool import AgentBlocks

FinishReason = Literal["stop", "length"]
#: Seeds are ints in ``[0, SEEDS)`` (MLX's random keys take 64 bits).
SEEDS = 1 << 64
#: Most stop strings a sequence may have, and most characters in each: each one is
#: looked for after every token, on the engine thread that serves every sequence.
MAX_STOPS, MAX_STOP_CHARS = 64, 1000
Sampler = Callable[[mx.array], mx.array]
#: mlx-lm's: ``processor(tokens, logits) -> logits``, ``tokens`` the sequence so far.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def check_stops(stop: object) -> tuple[str, ...]:
    """``stop`` (a string or a sequence of them) as a tuple of non-empty strings, within
    :data:`MAX_STOPS` and :data:`MAX_STOP_CHARS` (:class:`InvalidRequestError` if not)."""
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(
            f"stop must be a string or a sequence of non-empty strings, got {stop!r}"
        )
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequestError(
            f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each, "
            f"got {len(stops)} (the longest of {max(map(len, stops))})"
        )
    return tuple(stops)


def _bias(value: object) -> tuple[tuple[int, float], ...]:
    """A logit bias (a mapping of token ids to numbers, or pairs) as sorted pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"logit_bias must map token ids to numbers, got {value!r}"
        ) from None
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (ints >= 0), got {token!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidRequestError(f"logit_bias values must be finite numbers, got {bias!r}")
    return tuple(sorted((int(t), float(b)) for t, b in dict(pairs).items()))


def _number(name: str, value: object, low: float, high: float = math.inf) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not low <= value <= high
        or math.isnan(value)
    ):
        raise InvalidRequestError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def _count(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be an int in [{low}, {high}], got {value!r}")


#: Most alternatives ``top_logprobs`` may ask for per token.
MAX_TOP_LOGPROBS = 20


@attrs.frozen(kw_only=True)
class Sampling:
    """How the next token is chosen: mlx-lm's samplers and logits processors
    (``mlx_lm.sample_utils``), with a random stream of the sequence's own."""

    #: 0 picks the most likely token (greedy, the default); higher flattens the choice.
    temperature: float = 0.0
    #: Nucleus sampling: keep the most likely tokens whose mass reaches ``top_p``.
    top_p: float = 1.0
    #: Keep only the ``top_k`` most likely tokens (0: all).
    top_k: int = 0
    #: Keep only tokens at least ``min_p`` times as likely as the most likely (0: all).
    min_p: float = 0.0
    #: Divide the logits of the last ``repetition_context_size`` tokens' ids by this
    #: (multiply if negative; 1: off). The context is the whole conversation's tokens.
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    #: Subtract from the logits of ids among those tokens (once, or once per use).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Added to the logits of these token ids: ``((token, bias), ...)`` (or a mapping).
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias)
    #: Record the log-probability of each generated token.
    logprobs: bool = False
    #: And of the ``top_logprobs`` most likely tokens at each step (0: none).
    top_logprobs: int = 0
    #: Seed of this sequence's own random stream; ``None`` picks one at random.
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        _count("top_k", self.top_k, 0, 1 << 31)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 1e-6, 1e6)
        _count("repetition_context_size", self.repetition_context_size, 1, 1 << 20)
        _number("presence_penalty", self.presence_penalty, -1e6, 1e6)
        _number("frequency_penalty", self.frequency_penalty, -1e6, 1e6)
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError(f"logprobs must be True or False, got {self.logprobs!r}")
        _count("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS
        ):
            raise InvalidRequestError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")

    def make_sampler(self) -> Sampler | None:
        """A sampler with its own random key, or ``None`` for greedy decoding. The
        filters are mlx-lm's, in ``make_sampler``'s order (top-p, min-p, top-k)."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else random.getrandbits(63)
        key = [mx.random.key(seed)]
        inv_temp = 1.0 / self.temperature
        top_p, min_p, top_k = self.top_p, self.min_p, self.top_k
        # mlx-lm's apply_top_k refuses a k as large as the vocabulary: keep all then.

        def sample(logprobs: mx.array) -> mx.array:
            key[0], sub = mx.random.split(key[0])
            if top_p < 1.0:
                logprobs = apply_top_p(logprobs, top_p)
            if min_p > 0.0:
                logprobs = apply_min_p(logprobs, min_p)
            if 0 < top_k < logprobs.shape[-1]:
                logprobs = apply_top_k(logprobs, top_k)
            return mx.random.categorical(logprobs * inv_temp, key=sub)

        return sample

    def make_processors(self) -> list[LogitsProcessor]:
        """mlx-lm's logits processors for the penalties and the bias (none if off)."""
        return list(
            make_logits_processors(
                logit_bias=dict(self.logit_bias) or None,
                repetition_penalty=(
                    self.repetition_penalty if self.repetition_penalty != 1.0 else None
                ),
                repetition_context_size=self.repetition_context_size,
                presence_penalty=self.presence_penalty or None,
                presence_context_size=self.repetition_context_size,
                frequency_penalty=self.frequency_penalty or None,
                frequency_context_size=self.repetition_context_size,
            )
        )


@attrs.frozen(kw_only=True)
class Usage:
    """Tokens one turn cost."""

    #: New tokens run through the model before generating (the prefill).
    prompt_tokens: int
    #: History tokens taken from cache blocks instead of being prefilled again.
    cached_tokens: int
    #: Tokens generated.
    generated_tokens: int
    #: Of ``cached_tokens``, those taken from blocks other agents' turns computed.
    shared_tokens: int = 0
    #: History tokens the turn's prompt shares with the agent's own cache: the most it
    #: could take from it. More than ``cached_tokens`` when the cache could not serve
    #: them all (see :attr:`Admission.not_reused`).
    reusable_tokens: int = 0


@attrs.frozen(kw_only=True)
class Admission:
    """Where a submitted sequence starts, decided when it is submitted."""

    #: Prompt tokens whose cache comes from existing blocks.
    cached_tokens: int
    #: Of those, tokens from blocks other agents' turns computed.
    shared_tokens: int
    #: Prompt tokens left to prefill.
    prefill_tokens: int
    #: Prompt tokens the caller's own cache agrees with (at most ``cached_tokens`` when
    #: all of them could be reused).
    reusable_tokens: int = 0
    #: Why fewer than ``reusable_tokens`` come from the cache (``None`` if none are lost).
    not_reused: str | None = None
    #: The agent whose prefill computes a longer prefix this sequence waits for.
    waits_for: str | None = None
    #: How long that prefix is.
    waits_tokens: int = 0


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token, as it comes."""

    uid: int
    token: int
    #: Text that became printable with this token (may be empty; never half a character).
    text: str
    #: Its log-probability, when the sequence records them (``Sampling.logprobs``).
    logprob: float | None = None


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
    #: The stop string that ended the text, if one did.
    stop: str | None = None
    #: Each generated token's log-probability (with ``Sampling.logprobs`` or
    #: ``top_logprobs``), and the most likely tokens' at each step (``top_logprobs``):
    #: ``(token, logprob)`` pairs, most likely first. After the logits processors,
    #: before temperature and the sampler's filters (as mlx-lm reports them).
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
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
    #: Prefill jobs that ran a chunk, and the seconds they took (publishing included).
    jobs: int = 0
    jobs_seconds: float = 0.0
    #: Sequences that joined the batch, and the seconds of the ``BatchGenerator`` step.
    joined: int = 0
    batch_seconds: float = 0.0
    #: The agents whose prompts ran this step, and those that got a token.
    prefilled: tuple[str, ...] = ()
    decoded: tuple[str, ...] = ()


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
    #: Of ``cached_tokens``, tokens reused from blocks other agents' turns computed.
    shared_tokens: int = 0
    #: Prefills run as jobs outside the batch (long prompts, shared prefixes).
    prefill_jobs: int = 0
    #: Shared prefixes published by those jobs for sequences waiting on them.
    checkpoints: int = 0
    #: Of ``generated_tokens``, those decoded alone, outside the batch (``Solo``).
    solo_tokens: int = 0
    #: Sequences that started from their agent's kept cache instead of its blocks.
    hot_starts: int = 0
