"""What goes into the batch engine and what comes out: sampling settings, usage, where a
sequence starts, streamed tokens, finished generations and statistics."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from ..errors import InvalidRequestError
from ._pool import AgentBlocks

FinishReason = Literal["stop", "length"]
#: Seeds are ints in ``[0, SEEDS)`` (MLX's random keys take 64 bits).
SEEDS = 1 << 64
#: Most stop strings a sequence may have, and most characters in each: each one is
#: looked for after every token, on the engine thread that serves every sequence.
MAX_STOPS, MAX_STOP_CHARS = 64, 1000
Sampler = Callable[[mx.array], mx.array]


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
        seed = self.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS
        ):
            raise InvalidRequestError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")

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
    #: Prefill jobs that ran a chunk, and the seconds they took (publishing included).
    jobs: int = 0
    jobs_seconds: float = 0.0
    #: Sequences that joined the batch, and the seconds of the ``BatchGenerator`` step.
    joined: int = 0
    batch_seconds: float = 0.0


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
