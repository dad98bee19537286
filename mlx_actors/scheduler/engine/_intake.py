"""A submitted sequence checked at the engine's boundary: its settings, its prompt (text
or token ids inside the vocabulary), the cache it continues, and whether it can fit the
model's context and the pool at all; then made an :class:`EngineSequence`."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ...errors import ContextLengthError, InvalidRequestError
from ..kv._blocks import blocks_needed, check_blocks
from ..kv._pool import AgentBlocks, BlockPool
from ..kv._spec import ModelCacheSpec
from ._records import LogitsProcessor, Sampling, TokenEvent, check_stops
from ._sequence import EngineSequence
from ._text import TextStream


class Intake:
    """Checks and makes the sequences an engine is given."""

    def __init__(
        self, spec: ModelCacheSpec, pool: BlockPool, tokenizer: Any, vocab_size: int
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def sequence(
        self,
        uid: int,
        agent_id: str,
        prompt: Sequence[int] | str,
        cache: AgentBlocks | None,
        *,
        trim: int,
        max_tokens: int,
        sampling: Sampling | None,
        stop: Sequence[str],
        on_token: Callable[[TokenEvent], None] | None,
        namespace: Hashable,
        processors: Sequence[LogitsProcessor],
    ) -> EngineSequence:
        """The sequence ``BlockPoolBatchEngine.submit`` describes (see there for the
        arguments and the errors)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be an int > 0, got {max_tokens!r}")
        sampling = sampling if sampling is not None else Sampling()
        bad_bias = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias names token ids {bad_bias[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        stops = check_stops(stop)
        if cache is not None:
            check_blocks(self.pool, cache)
        history_len = cache.num_tokens if cache is not None else 0
        if isinstance(trim, bool) or not isinstance(trim, int) or not 0 <= trim <= history_len:
            raise InvalidRequestError(
                f"trim must be an int in [0, {history_len}] (the cached tokens), got {trim!r}"
            )
        kept = history_len - trim
        tokens = self._encode(prompt, fresh=kept == 0)
        total = kept + len(tokens)
        limit = self.spec.context_length
        if limit is not None and total >= limit:
            raise ContextLengthError(
                f"the prompt ({len(tokens)} new + {kept} cached tokens) leaves no room in "
                f"the model's context of {limit} tokens; shorten the conversation"
            )
        budget = min(max_tokens, limit - total) if limit is not None else max_tokens
        need = blocks_needed(self.spec, total + budget, kept)
        if need > self.pool.total_blocks:
            what = "blocks" if self.spec.max_units == 1 else "pool units"
            raise ContextLengthError(
                f"the turn may need {need} {what} ({total} prompt tokens + {budget} new), "
                f"more than the whole pool of {self.pool.total_blocks}; lower max_tokens, "
                "shorten the conversation or give the runtime a larger pool"
            )
        full = [*cache.tokens[:kept], *tokens] if cache is not None and kept else tokens
        anchors = tuple(a for a in cache.anchors if a <= kept) if cache is not None else ()
        seq = EngineSequence(
            uid=uid,
            agent_id=agent_id,
            namespace=namespace,
            tokens=full,
            kept=kept,
            own=cache if kept else None,
            anchors=anchors,
            budget=budget,
            sampler=sampling.make_sampler(),
            processors=[*sampling.make_processors(), *processors],
            logprobs=[] if sampling.logprobs or sampling.top_logprobs else None,
            top=sampling.top_logprobs,
            text=TextStream(self.tokenizer.detokenizer, stops),
            on_token=on_token,
            submitted=time.perf_counter(),
        )
        return seq

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
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return tokens

    # -- running ----------------------------------------------------------------------
