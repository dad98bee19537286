"""What running sequences hand back: each token's text (whole characters, stop strings),
its log-probabilities and the caller's callback; and, when a sequence ends, its cache
cut into blocks (through the index: blocks that exist are shared) and its result."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ..kv._blocks import from_cache
from ..kv._pool import BlockPool
from ..kv._prefix import PrefixIndex
from ..kv._spec import ModelCacheSpec
from ._records import CompletedGeneration, FinishReason, TokenEvent, Usage
from ._sequence import EngineSequence, SequenceState, record_logprobs
from ._solo import KeptCaches


class Output:
    """The output stage of the engine, and its counts."""

    def __init__(
        self,
        spec: ModelCacheSpec,
        pool: BlockPool,
        index: PrefixIndex,
        kept_caches: KeptCaches,
        eos: frozenset[int],
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.index = index
        #: Caches of sequences that finished alone, for their agents' next turns.
        self.kept_caches = kept_caches
        self.eos = eos
        #: Tokens emitted in the step under way (the engine resets it each step).
        self.decoded = 0
        self.completed = self.cached_tokens = self.shared_tokens = 0

    def emit(
        self,
        seq: EngineSequence,
        token: int,
        reason: str | None,
        now: float,
        logprobs: mx.array | None = None,
    ) -> FinishReason | None:
        """Take a token ``seq`` generated (``reason``: why the generator ends it there;
        ``logprobs``: the distribution it was chosen from); stream its text. Returns
        why the sequence ends here (a stop string counts), if it does."""
        self.decoded += 1
        seq.generated.append(token)
        logprob = None
        if seq.logprobs is not None and logprobs is not None:
            logprob = record_logprobs(seq, token, logprobs.reshape(-1))
        if seq.first_token is None:
            seq.first_token = now
        finish: FinishReason | None = reason  # type: ignore[assignment]
        piece, matched = seq.text.add(token, eos=reason == "stop" and token in self.eos)
        if matched:
            finish = "stop"
        if finish is not None:
            last, matched = seq.text.finish()
            piece += last
            if matched:  # held back until now (the last token's text): a stop after all
                finish = "stop"
        if seq.on_token is not None:
            seq.on_token(TokenEvent(uid=seq.uid, token=token, text=piece, logprob=logprob))
        return finish

    def finish(
        self, seq: EngineSequence, cache: list[Any], reason: FinishReason
    ) -> CompletedGeneration:
        assert seq.reservation is not None
        tokens = (*seq.tokens, *seq.generated)
        if (
            seq.state is SequenceState.SOLO
        ):  # the cache is the sequence's own: keep it for its agent
            self.kept_caches.keep(seq.agent_id, tokens, cache)
        try:
            blocks = from_cache(
                self.pool,
                cache,
                tokens,
                seq.reservation,
                index=self.index,
                namespace=seq.namespace,
                path=seq.source.path,
                anchors=seq.anchors,
                checkpoint=seq.checkpoint or seq.source.layers,
                source=seq.source.layers,
                pinned=seq.held,
            )
        finally:
            seq.release(self.pool)
        now = time.perf_counter()
        cached = seq.source.length
        shared = max(0, cached - seq.kept)
        self.completed += 1
        self.cached_tokens += cached
        self.shared_tokens += shared
        return CompletedGeneration(
            uid=seq.uid,
            agent_id=seq.agent_id,
            tokens=tuple(seq.generated),
            text=seq.text.text,
            stop=seq.text.stop,
            logprobs=tuple(seq.logprobs) if seq.logprobs is not None else None,
            top_logprobs=tuple(seq.top_logprobs) if seq.top else None,
            finish_reason=reason,
            blocks=blocks,
            usage=Usage(
                prompt_tokens=len(seq.tokens) - cached,
                cached_tokens=cached,
                generated_tokens=len(seq.generated),
                shared_tokens=shared,
                reusable_tokens=seq.kept,
            ),
            submitted_at=seq.submitted,
            ttft_s=(seq.first_token or now) - seq.submitted,
            total_s=now - seq.submitted,
        )
